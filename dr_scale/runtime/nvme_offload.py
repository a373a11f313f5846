"""ZeRO-Infinity's NVMe offload (`ds_configs/zero3_nvme.json`): where its swap files go and what
it needs from the system, checked before any rank builds the model.

DeepSpeed swaps optimizer state (and, if asked, parameters) through its async_io op, which it
compiles on first use against libaio; without libaio's headers and library the engine fails deep
inside initialisation. So the launcher asks DeepSpeed's own builder first (it compiles and links
a two-line program against libaio: ~0.1 s) and stops in one line naming the package. The op
itself then builds once per machine (kept in torch's extension cache): measured 3 min 40 s on
this project's 2-core CPUs, which the start line warns of.

`"nvme_path": "auto"` puts the swap files in the run folder's `offload/`; on a cluster give a
node-local NVMe mount instead (a shared file system works, slowly). Each rank writes its own
`zero_stage_3/<kind>/rank<N>/` there.
"""
import os
import re
from pathlib import Path
from typing import Dict, List, Optional

from dr_scale.errors import DrScaleError

SECTIONS = ("offload_optimizer", "offload_param")
SAVED = "offloaded_tensors"  # DeepSpeed's copy of the swap files inside a checkpoint


def saved_swap_dir(tag_dir: Path, rank: int) -> Path:
    """Where DeepSpeed's save_checkpoint copies `rank`'s swap files in a checkpoint."""
    return Path(tag_dir) / SAVED / f"rank{rank:02d}"
PACKAGE_HINT = ("libaio (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Rocky: dnf install "
                "libaio-devel; elsewhere set CFLAGS/LDFLAGS to its headers and library)")


def nvme_sections(ds: Dict) -> List[str]:
    """The offload sections of a DeepSpeed JSON that put their tensors on NVMe."""
    zero = ds.get("zero_optimization", {}) or {}
    return [s for s in SECTIONS if ((zero.get(s) or {}).get("device") == "nvme")]


def optimizer_on_nvme(ds: Dict) -> bool:
    """Whether the run swaps its optimizer state to NVMe (DeepSpeed's swap_optimizer)."""
    return "offload_optimizer" in nvme_sections(ds)


def fill_paths(ds: Dict, run_dir: Optional[Path], raw: Optional[Dict] = None) -> None:
    """`"nvme_path": "auto"` (as `raw` says, default `ds`) -> <run folder>/offload, in place.
    Before the run folder is chosen (the plan) a placeholder stands for it."""
    for section in nvme_sections(ds):
        conf = ds["zero_optimization"][section]
        asked = ((raw or ds).get("zero_optimization", {}).get(section) or {})
        if asked.get("nvme_path", "auto") == "auto":
            conf["nvme_path"] = str(Path(run_dir or "<run folder>") / "offload")


def check_system(ds: Dict, source: str) -> None:
    """One line when DeepSpeed cannot build its async_io op here (before the process group)."""
    sections = nvme_sections(ds)
    if not sections:
        return
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        where = ", ".join(f"zero_optimization.{s}.device=nvme" for s in sections)
        raise DrScaleError(f"{source}: {where} needs DeepSpeed's async_io op, which cannot be "
                           f"built here: it needs {PACKAGE_HINT}; or use --ds_config "
                           "zero3_offload (host memory)")


def prepare_dirs(ds: Dict, source: str) -> Optional[str]:
    """Make each nvme_path and check it takes a file; a note for the start line, or None."""
    sections = nvme_sections(ds)
    if not sections:
        return None
    paths = sorted({ds["zero_optimization"][s]["nvme_path"] for s in sections})
    for p in paths:
        probe = Path(p) / f".write_test.{os.getpid()}"  # each rank its own: they share the folder
        try:
            Path(p).mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as e:
            raise DrScaleError(f"{source}: zero_optimization.*.nvme_path={p}: cannot write there "
                               f"({e.strerror}); give a writable local NVMe folder") from None
    what = " and ".join({"offload_optimizer": "optimizer state",
                         "offload_param": "parameters"}[s] for s in sections)
    return (f"{what} on NVMe in {', '.join(paths)} (DeepSpeed builds its async_io op on first "
            "use: minutes, once per machine)")


def swap_in_each_parameter_once() -> None:
    """Make DeepSpeed's parameter swapper swap a parameter in once however often it is asked in
    one call. DeepSpeed 0.19.8's NVMe prefetch (the parameter coordinator's
    `__prefetch_nvme_param_partitions`) walks the step's parameter trace, in which a parameter
    that two modules share (tied embeddings: the embedding and the LM head) appears twice, and
    passes both to `swap_in`: the second buffer assignment asserts ("param N already assigned swap
    buffer id M") at the first step with a recorded trace, the second. Repeats are dropped before
    DeepSpeed's own swap_in (not where the coordinator builds the list: that method is private)."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
        AsyncPartitionedParameterSwapper as Swapper)

    plain = Swapper.swap_in
    if getattr(plain, "dr_scale_once", False):
        return

    def swap_in(self, params, async_op=True, swap_in_buffers=None):
        if swap_in_buffers is None:  # given buffers pair with params one to one: left alone
            seen = set()
            params = [p for p in params if not (p.ds_id in seen or seen.add(p.ds_id))]
        return plain(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

    swap_in.dr_scale_once = True
    Swapper.swap_in = swap_in


def restore_optimizer_state(engine, load_dir, tag: str) -> None:
    """Give Adam back its step counts and moments after DeepSpeed loads an NVMe-offloaded
    checkpoint. DeepSpeed 0.19.8 copies the checkpoint's swap files (fp32 master weights and
    moments) back into the swap folder but skips the optimizer's state dict, so the optimizer
    holds no state: at the next step CPU Adam starts again at step 1 with zero moments, the
    swapped moments are never read, the sub-groups kept in memory lose theirs and their fp32
    master weights (the norms' went back to their initial values), and the param groups keep
    the first step's learning rate for the step after the resume (measured: a resume at step 3
    of 6 matched the uninterrupted run at step 4, not at 5 and 6).

    Here the param groups' settings and each sub-group's state are set from this rank's saved
    state dict, read memory-mapped: an in-memory sub-group takes its saved state and fp32
    weights (and their 16-bit copy, as DeepSpeed's own load does); a swapped one takes its step
    and two placeholders of its size whose pages are never touched (no memory), which the
    swapper registers by name at the next swap-in and fills from the restored files."""
    import torch

    opt = engine.optimizer
    if not getattr(opt, "swap_optimizer", False):
        return
    path = engine._get_zero_ckpt_name(str(load_dir), tag)
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    fp32_groups = saved["optimizer_state_dict"]["fp32_flat_groups"]
    saved = saved["optimizer_state_dict"]["optimizer_state_dict"]
    states = saved["state"]
    for group, saved_group in zip(opt.optimizer.param_groups, saved["param_groups"]):
        # lr as the step to come uses it: the schedule sets it only after that step
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    # the state dict numbers the sub-groups as DeepSpeed lists them in its param groups: by
    # group, then sub-group (DeepSpeedZeroOptimizer_Stage3._set_fp32_optimizer_param_groups)
    order = sorted(range(len(opt.fp32_partitioned_groups_flat)),
                   key=lambda sg: (opt.sub_group_to_group_id[sg], sg))
    for index, sub_group in enumerate(order):
        param, state = opt.fp32_partitioned_groups_flat[sub_group], states.get(index, {})
        if opt._swappable_optimizer_subgroup(sub_group):  # swapped out: the parameter is empty
            numel = int(opt.fp16_partitioned_groups_flat_numel[sub_group])
            opt.optimizer.state[param] = {
                key: (torch.empty(numel, dtype=value.dtype) if torch.is_tensor(value) else value)
                for key, value in state.items()}
            continue
        # kept in memory: its state, and its fp32 master weights with their 16-bit copy
        opt.optimizer.state[param] = {key: (value.clone() if torch.is_tensor(value) else value)
                                      for key, value in state.items()}
        param.data.copy_(fp32_groups[sub_group])
        low = opt.fp16_partitioned_groups_flat[sub_group]
        parts = opt.fp16_partitioned_groups[sub_group]
        low.data.copy_(param.data)
        for part, value in zip(parts, opt.unflatten(low, parts)):
            part.data = value.data


def saved_swap_files(engine, tag_dir: Path) -> List[Path]:
    """The swap files DeepSpeed copied into this rank's part of a checkpoint it just saved
    (`offloaded_tensors/rankNN/`, named as DeepSpeed's save_checkpoint names it). It copies them
    itself, not through the checkpoint engine, so the checkpoint writer adds them to the files
    this rank fsyncs before the checkpoint is published."""
    if not getattr(getattr(engine, "optimizer", None), "swap_optimizer", False):
        return []
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    return sorted(p for p in saved_swap_dir(tag_dir, rank).rglob("*") if p.is_file())


def swapper_error(exc: BaseException, ds_source: str) -> Optional[str]:
    """One line for the assertions of DeepSpeed's parameter swapper (offload_param to NVMe), raised
    deep in the model's build or a forward; None for any other error. With `max_in_cpu` below a
    rank's partition every parameter in use takes one of `buffer_count` page-locked buffers of
    `buffer_size` elements until it is released."""
    text = str(exc).strip()
    if not isinstance(exc, AssertionError):
        return None
    key = f"{ds_source}: zero_optimization.offload_param"
    too_big = re.match(r"More elements (\d+) than buffer size (\d+)", text)
    if too_big:
        return (f"{key}.buffer_size={too_big.group(2)}: a parameter's partition has "
                f"{too_big.group(1)} elements; buffer_size must hold the largest one")
    if text.startswith("Not enough buffers"):
        return (f"{key}.buffer_count: DeepSpeed ran out of parameter swap buffers ({text}): more "
                f"parameters were in use at once than there are buffers; raise buffer_count, "
                f"lower stage3_max_live_parameters and stage3_prefetch_bucket_size, or raise "
                f"max_in_cpu to keep more of the partition in memory")
    if "already assigned swap buffer" in text:  # a repeat swap_in_each_parameter_once missed
        import deepspeed

        return (f"{key}.max_in_cpu: DeepSpeed {deepspeed.__version__}'s parameter swapper failed "
                f"({text}) with parameters in files; raise max_in_cpu above a rank's partition "
                f"to keep them in memory")
    return None
