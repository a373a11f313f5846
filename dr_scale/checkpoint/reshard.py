"""Resharding a checkpoint for another number of ranks or ZeRO family: DeepSpeed's universal
checkpoint format, made once per tag and target under checkpoints/universal/.

The conversion runs before any process group exists: offline as `dr-scale reshard`, or at a
`--resume` that needs it, where rank 0 converts while the other ranks wait for its output on the
file system (universal_ready) instead of in a collective bounded by train.collective_timeout_s.
DeepSpeed's ds_to_universal does the work with parallel workers: one extracting each rank's
optimizer file, others merging each parameter's fragments; their number is bounded by the cores
and by host memory. It reads the checkpoint memory-mapped (universal_stream.py), so a worker holds
the fragment it cuts rather than a rank's whole file.
"""
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from deepspeed.checkpoint.constants import (PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                            PIPELINE_REPLICATED_PARAMETER_PATTERNS,
                                            UNIVERSAL_CHECKPOINT_INFO)

from dr_scale.runtime import nvme_offload
from dr_scale.errors import DrScaleError
from dr_scale.checkpoint.layout import (STATE_FILE, TargetLayout, rank0_model_states,
                                       ranks_written, saved_model,
                                       saved_optimizer, saved_parallel_layout,
                                       saved_sub_group_size,
                                       saved_zero_family, universal_dir)

FAILED = ".{tag}.failed"  # rank 0's one-line error, for the ranks waiting on its output
CONVERTING = ".{tag}.tmp"  # a conversion's output until it is whole, renamed into place


def reshard_plan(ckpt_dir: Path, tag: str, target: TargetLayout, target_nvme: bool = False,
                 sub_group_size: Optional[int] = None):
    """How to load ``tag`` into this run: "direct", or "universal" (DeepSpeed's universal
    checkpoint, converted on first use); one line of error where neither can work.
    `target_nvme`: the run keeps its optimizer state on NVMe (offload_optimizer.device=nvme);
    `sub_group_size`: the run's zero_optimization.sub_group_size (ZeRO-3 lays its optimizer
    state out by it, and DeepSpeed loads another layout only through the universal form)."""
    tag_dir = Path(ckpt_dir) / tag
    written = ranks_written(tag_dir)
    saved = saved_parallel_layout(tag_dir)
    family = saved_zero_family(tag_dir)
    world_size = target.world
    target_family = {0: 0, 1: 1, 2: 1, 3: 3}[target.stage]
    layout_changes = saved != (target.tensor, target.pipeline, target.expert) or (
        max(saved) > 1 and (written != world_size or family != target_family))
    if layout_changes:
        _refuse_layout_change(tag_dir, saved, target, written, family)
    shards = {0: None, 1: "*zero_pp_rank_*_optim_states.pt", 3: "zero_pp_rank_*_model_states.pt"}
    if shards[family] and len(list(tag_dir.glob(shards[family]))) != written:
        raise DrScaleError(f"{tag_dir}: dr_scale state of {written} rank(s) but DeepSpeed shards "
                           f"of {len(list(tag_dir.glob(shards[family])))} (incomplete checkpoint)")
    if layout_changes:  # a change of tensor- or pipeline-parallel size: through it (tested exact)
        _refuse_universal_with_nvme(tag_dir, written, world_size, target_nvme)
        return _universal(tag_dir, saved, written, family, target)
    if written == world_size and family == target_family:
        saved_groups = saved_sub_group_size(tag_dir)
        if family != 3 or sub_group_size in (None, saved_groups):
            return "direct"
        if target_nvme or (tag_dir / nvme_offload.SAVED).is_dir():
            raise DrScaleError(
                f"{tag_dir}: written with zero_optimization.sub_group_size={saved_groups}, "
                f"resumed with {sub_group_size} and optimizer state on NVMe, which DeepSpeed "
                f"cannot re-lay out (its universal checkpoint does not meet swapped state): "
                f"resume with sub_group_size {saved_groups}")
        return _universal(tag_dir, saved, written, family, target)  # state in other sub-groups
    if family == 0 and target_family == 0:
        return "direct"  # ZeRO-0 keeps whole states in one file: any number of ranks loads it
    if family and target_family:
        _refuse_universal_with_nvme(tag_dir, written, world_size, target_nvme)
        return _universal(tag_dir, saved, written, family, target)
    names = {0: "ZeRO-0", 1: "ZeRO-1/2", 3: "ZeRO-3"}
    raise DrScaleError(
        f"{tag_dir}: a {names[family]} checkpoint ({written} rank(s)) cannot be resumed at "
        f"ZeRO-{target.stage}: ZeRO-0 keeps no partitioned optimizer state to reshard; resume "
        "it at ZeRO-0, or carry the weights without optimizer state through `dr-scale export` "
        "and model.init_from")


def _universal(tag_dir: Path, saved: tuple, written: int, family: int,
               target: TargetLayout) -> str:
    """"universal", unless the checkpoint's optimizer state cannot take that way."""
    if saved_optimizer(tag_dir) == "muon" and (
            target.pipelined or target.expert > 1 or max(saved[1:]) > 1):
        # Muon's momentum goes through the universal form as muon_state.py carries it, between
        # plain and tensor-parallel layouts at any ZeRO stage; pipeline stages' names and expert
        # groups it has not met
        names = {0: "ZeRO-0", 1: "ZeRO-1/2", 3: "ZeRO-3"}
        raise DrScaleError(
            f"{tag_dir}: a Muon checkpoint ({written} rank(s), {names[family]}, TP {saved[0]} x "
            f"PP {saved[1]} x EP {saved[2]}) changes layout only without pipeline or expert "
            f"parallelism on either side, where dr_scale carries Muon's momentum; resume with "
            f"such a layout, or on the one that wrote it")
    return "universal"


def _refuse_layout_change(tag_dir: Path, saved: tuple, target: TargetLayout, written: int,
                          family: int) -> None:
    """A change of tensor- or pipeline-parallel size (and of the data-parallel size with it)
    goes through DeepSpeed's universal form. Tensor parallelism: AutoTP records which of its
    parameters are row-parallel, replicated or sliced by vocabulary in the checkpoint,
    ds_to_universal joins the slices by it, and the load cuts them again for the new tensor rank.
    Pipelines: their parameters are named by layer index, renamed to the model's and back
    (universal.py); under tensor parallelism each stage's AutoTP record goes into every file
    (parallel/pipeline.py). ZeRO-3 joins in both directions: ds_to_universal joins a ZeRO-3
    checkpoint's tensor-parallel slices by the same record, and ZeRO-3's load cuts each tensor to
    the rank's slice by the AutoTP metadata our build keeps on its parameters (universal.py says
    what the two families' forms need). Tested exact in tests/test_reshard.py: TP x PP both
    ways, DP x TP at ZeRO-3 <-> DP at ZeRO-1, a pipeline to ZeRO-3."""
    was = (f"tensor_parallel={saved[0]} x pipeline_parallel={saved[1]} (expert_parallel="
           f"{saved[2]}) on {written} rank(s)")
    now = (f"{target.tensor} x {target.pipeline} ({target.expert}) on {target.world} at "
           f"ZeRO-{target.stage}")
    way_out = ("resume it on its own layout, or `dr-scale export` the weights and start a run "
               "from them with model.init_from (a fresh optimizer)")
    if 0 in (family, target.stage):
        raise DrScaleError(
            f"{tag_dir}: written with {was}, resumed with {now}: a change of layout goes through "
            f"DeepSpeed's universal form, which ZeRO-0 neither writes nor reads; {way_out}")
    if any(tensor > 1 and expert > 1 for tensor, expert in
           ((saved[0], saved[2]), (target.tensor, target.expert))):
        raise DrScaleError(
            f"{tag_dir}: written with {was}, resumed with {now}: a change of layout goes through "
            f"DeepSpeed's universal form, whose ZeRO-1/2 conversion (0.19.8) refuses experts "
            f"split over ranks with tensor parallelism; {way_out}")
    if saved[2] != target.expert and 3 in (family, target.stage) and max(saved[2],
                                                                     target.expert) > 1:
        # measured (moe_tiny, EP 2 at ZeRO-3 -> EP 1): "AutoEP universal expert checkpoint
        # target parameter is missing its EP group name"; the same EP size on more ranks, and
        # ZeRO-3 <-> ZeRO-2 at it, convert and continue the losses
        raise DrScaleError(
            f"{tag_dir}: written with {was}, resumed with {now}: DeepSpeed 0.19.8 changes the "
            f"expert-parallel size through its universal form at ZeRO-1/2 only (its ZeRO-3 "
            f"load of experts needs the same size); resume with expert_parallel={saved[2]} "
            f"(any data-parallel size, ZeRO-2 or 3), or convert at ZeRO-2 first")
    record = _conversion_record(tag_dir) if max(saved) > 1 else {}
    if saved[1] > 1 and PIPELINE_REPLICATED_PARAMETER_PATTERNS not in record \
            and saved_model(tag_dir).get("tie_embeddings", True):
        raise DrScaleError(
            f"{tag_dir}: a pipeline with tied embeddings, written by a dr_scale that did not "
            f"record which stage's copy of the tied layer is the trained one (the conversion "
            f"could take the other's); {way_out}")
    if saved[0] > 1 and PARAMETER_WITH_ROW_PARALLELISM_PATTERNS not in record:
        raise DrScaleError(
            f"{tag_dir}: written with tensor_parallel={saved[0]} by a dr_scale that did not keep "
            f"AutoTP's record of its row-parallel parameters, without which the conversion joins "
            f"their slices on the wrong dimension; {way_out}")


def _model_states(tag_dir: Path) -> dict:
    """Tensor rank 0's model-states file of the checkpoint (empty where none)."""
    found = rank0_model_states(tag_dir)  # (an expert's file sorts before it)
    if found is None:
        return {}
    # DeepSpeed's own file (DeepSpeed loads it with weights_only=False too); mmap: no weights read
    return torch.load(found, map_location="cpu", weights_only=False, mmap=True)


def _conversion_record(tag_dir: Path) -> dict:
    """The checkpoint's universal-checkpoint record (DeepSpeed's key; empty where none)."""
    return _model_states(tag_dir).get(UNIVERSAL_CHECKPOINT_INFO) or {}


def _refuse_universal_with_nvme(tag_dir: Path, written: int, world_size: int,
                                target_nvme: bool) -> None:
    """DeepSpeed 0.19.8's universal checkpoint and ZeRO-Infinity's swapped optimizer state do
    not meet: ds_to_universal reads each sub-group's fp32 weights and moments from the rank's
    optimizer file, where a swapped sub-group's are empty (they are the swap files DeepSpeed
    copied beside it); and load_hp_checkpoint_state_from_checkpoint_dir_stage3 fills each
    sub-group's fp32 tensor in memory, which is empty for a swapped one. Either would fail deep
    in a worker or, worse, load nothing; say so before anything starts."""
    way_out = ("to change the number of ranks, `dr-scale export` the weights and start a run from "
               "them with model.init_from (a fresh optimizer)")
    if (tag_dir / nvme_offload.SAVED).is_dir():
        raise DrScaleError(
            f"{tag_dir}: its optimizer state is on NVMe (ZeRO-Infinity's swap files in "
            f"{nvme_offload.SAVED}/), so it resumes on its {written} rank(s) only: DeepSpeed's "
            f"universal checkpoint reads the state from the rank files, where the swapped "
            f"sub-groups are empty; {way_out}")
    if target_nvme:
        raise DrScaleError(
            f"{tag_dir}: written by {written} rank(s); resuming on {world_size} needs DeepSpeed's "
            f"universal checkpoint, which it cannot load into optimizer state on NVMe "
            f"(offload_optimizer.device=nvme: the swapped sub-groups are not in memory to fill); "
            f"resume it on {written} rank(s), or without NVMe offload, or {way_out}")


def universal_ready(ckpt_dir: Path, tag: str, target: TargetLayout) -> bool:
    return (universal_dir(ckpt_dir, target) / tag / STATE_FILE.format(rank=0)).is_file()


def default_workers(tag_dir: Path) -> int:
    """As many as there are cores and rank files, while each worker's own memory fits in half
    the available memory: the files are mapped (universal_stream.py), so a worker holds the
    largest parameter's pieces and the tensor joined from them (2 x 4 bytes an element,
    measured below that in benchmarks/reshard.py) beside the interpreter and its imports."""
    import psutil

    files = list(Path(tag_dir).glob("*optim_states.pt"))
    per_worker = 8 * _largest_joined_tensor(Path(tag_dir)) + 512 * 2**20
    by_memory = int(psutil.virtual_memory().available * 0.5 // per_worker)
    return max(1, min(os.cpu_count() or 1, len(files) or 1, by_memory))


def _largest_joined_tensor(tag_dir: Path) -> int:
    """Elements of the checkpoint's largest parameter, its tensor-parallel slices joined."""
    shapes = [shape for group in _model_states(tag_dir).get("param_shapes") or []
              for shape in group.values()]
    largest = max((torch.Size(shape).numel() for shape in shapes), default=0)
    return largest * saved_parallel_layout(tag_dir)[0]


def convert_to_universal(ckpt_dir: Path, tag: str, target: TargetLayout,
                         workers: Optional[int] = None, show_progress: bool = True) -> Path:
    """Run DeepSpeed's ds_to_universal once per tag and target, then adapt it to the target's
    ZeRO family if the source was the other one; our rank-0 state goes along. DeepSpeed's
    progress bars (percent, rate, ETA) go to stderr. A failure leaves a one-line note for the
    ranks waiting on the output, and nothing in the checkpoint changed."""
    from dr_scale.checkpoint import universal

    ckpt_dir = Path(ckpt_dir)
    source = saved_zero_family(ckpt_dir / tag)
    out = universal_dir(ckpt_dir, target) / tag
    if universal_ready(ckpt_dir, tag, target):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = out.parent / FAILED.format(tag=tag)
    failed.unlink(missing_ok=True)
    workers = workers or default_workers(ckpt_dir / tag)
    tmp = out.parent / CONVERTING.format(tag=tag)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ds_to_universal(ckpt_dir / tag, tmp, workers, show_progress)
        if source == 3 and target.stage in (1, 2):
            universal.zero3_to_zero12(tmp)
        elif source == 1 and target.stage == 3:
            universal.zero12_to_zero3(tmp, target.world)
        elif source == 3:
            for tensor_rank in universal.model_states_ranks(
                    tmp, "zero_pp_rank_0_mp_rank_*_model_states.pt"):
                universal.zero3_model_states(
                    tmp, tmp / f"zero_pp_rank_0_mp_rank_{tensor_rank}_model_states.pt",
                    tensor_rank, target.world)
        signature = saved_model(ckpt_dir / tag)
        if saved_parallel_layout(ckpt_dir / tag)[1] > 1:  # a pipeline's names -> the model's
            universal.from_pipeline_names(tmp, signature)
        if target.pipelined:
            universal.to_pipeline_names(tmp, signature)
        if target.stage in (1, 2) and saved_parallel_layout(ckpt_dir / tag)[2] != target.expert:
            universal.to_expert_groups(tmp, target.expert)
        shutil.copyfile(ckpt_dir / tag / STATE_FILE.format(rank=0), tmp / STATE_FILE.format(rank=0))
    except DrScaleError as e:
        failed.write_text(str(e) + "\n")
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def ds_to_universal(tag_dir: Path, out: Path, workers: int, show_progress: bool):
    cmd = [sys.executable, "-m", "dr_scale.checkpoint.universal_stream", "--input_folder",
           str(tag_dir), "--output_folder", str(out), "--num_extract_workers", str(workers),
           "--num_merge_workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail = bytearray()

    def relay():  # tqdm's bars through to our stderr; the tail kept for an error line
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            if show_progress:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            tail.extend(chunk)
            del tail[:-8192]
    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join()
    if code != 0:
        lines = [ln for ln in tail.decode(errors="replace").replace("\r", "\n").splitlines()
                 if ln.strip()]
        raise DrScaleError(f"{tag_dir}: conversion to a universal checkpoint failed "
                           f"({(lines or ['?'])[-1][:200]})")


def wait_for_universal(ckpt_dir: Path, tag: str, target: TargetLayout, stall_s: int,
                       poll_s: float = 0.5):
    """Another rank converts (before any process group exists): wait for its output; give up
    with its error line, or when the conversion has written nothing for `stall_s` seconds. An
    error line older than this process is an earlier job's (rank 0 removes it when it starts
    converting, maybe after this rank looked): it stops nothing."""
    out = universal_dir(ckpt_dir, target)
    failed = out / FAILED.format(tag=tag)
    started = process_start_time()
    last_change, last_size = time.monotonic(), -1
    while not universal_ready(ckpt_dir, tag, target):
        if _written_since(failed, started):
            raise DrScaleError(failed.read_text().strip())
        size = _bytes_under(out / CONVERTING.format(tag=tag))
        if size != last_size:
            last_change, last_size = time.monotonic(), size
        elif time.monotonic() - last_change > stall_s:
            raise DrScaleError(
                f"{Path(ckpt_dir) / tag}: waited {stall_s} s for rank 0's conversion to a "
                f"universal checkpoint with no progress; convert it first with `dr-scale "
                f"reshard --run_dir {Path(ckpt_dir).parent} --ranks {target.world} "
                f"--zero_stage {target.stage}`, then resume")
        time.sleep(poll_s)


def prune_leftovers(ckpt_dir: Path) -> list:
    """Remove what killed conversions left under checkpoints/universal/ (a whole model with its
    optimizer state each) and earlier jobs' error lines; by the one process that converts, before
    it does. Returns what it removed."""
    universal = Path(ckpt_dir) / "universal"
    found = [*universal.glob("*/" + CONVERTING.format(tag="*")),
             *universal.glob("*/" + FAILED.format(tag="*"))]
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def process_start_time() -> float:
    """When this process started (seconds since the epoch)."""
    import psutil

    return psutil.Process().create_time()


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def _bytes_under(folder: Path) -> int:
    try:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    except OSError:  # renamed while we looked: done
        return -2
