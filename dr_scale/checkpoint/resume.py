"""Resuming a run folder: `--resume auto` settled, the checkpoint to continue from and how it
loads (directly, or converted once to DeepSpeed's universal form), and the run folder itself."""
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dr_scale.runtime import comm
from dr_scale.runtime.ranks import global_rank, warn
from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.checkpoint import manifest
from dr_scale.checkpoint.layout import (LATEST, TargetLayout, complete_tags, find_tag,
                                        latest_tag, refuse_other_shape, saved_model,
                                        saved_optimizer, saved_position, step_of)
from dr_scale.checkpoint.reshard import (convert_to_universal, prune_leftovers, reshard_plan,
                                         universal_ready, wait_for_universal)

# What marks a folder as a run folder (--resume auto starts fresh only in one of these or none)
# (slurm_failures, suspect_hosts: written by launchers/slurm_pretrain.sbatch and the launcher
# after an attempt that failed before the run wrote anything: the requeue must start it)
RUN_FILES = ("config.yaml", "run.json", "metrics.jsonl", "checkpoints", "ds_config.json",
             "slurm_failures", "suspect_hosts")


def resume_decision(args) -> tuple:
    """(resume?, a fresh start in a run folder that never saved?), reading the run folder and
    changing nothing: --resume auto resumes when the folder holds a complete checkpoint, starts
    fresh when it is absent, empty, or a run folder without one (a run that stopped before its
    first save: its records are set aside, its staging leftovers cleared by `prepare_files`)."""
    if args.resume != "auto":
        return args.resume is not None, False
    if not args.run_dir:
        raise DrScaleError("--resume auto: needs --run_dir (the folder to continue or start)")
    run_dir = Path(args.run_dir)
    if complete_tags(run_dir / "checkpoints"):
        return True, False
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return False, False
    if not any((run_dir / name).exists() for name in RUN_FILES):
        raise DrScaleError(f"{run_dir}: --resume auto: not a dr_scale run folder (none of "
                           f"{', '.join(RUN_FILES)}); choose another --run_dir")
    return False, True


def refuse_old_checkpoints(run_dir, resume: bool, fresh_over_old: bool):
    """A fresh start never writes over a run folder's checkpoints (the plan, when the folder is
    named)."""
    if run_dir is not None and not resume and not fresh_over_old \
            and (run_dir / "checkpoints").exists():
        raise DrScaleError(f"{run_dir}: already holds checkpoints; pass --resume to continue it, "
                           "or choose another --run_dir")


def default_run_dir() -> Path:
    """runs/<date>-<time>, one name for all ranks (rank 0's, broadcast), with a suffix where a
    job started in the same second took it."""
    name = None
    if global_rank() == 0:
        base = Path(time.strftime("runs/%Y%m%d-%H%M%S")).resolve()
        name, n = base, 1
        while name.exists():
            n += 1
            name = base.with_name(f"{base.name}-{n}")
    return Path(comm.broadcast_object(name))


def prepare_files(plan):
    """The step between the plan and the process group that writes: a fresh start's staging
    leftovers cleared, and what killed conversions left pruned. Global rank 0 writes (the run
    folder is shared). The checkpoint itself is checked, and converted where the layout changed,
    once the ranks can agree (checkpoint/agree.py)."""
    if plan.fresh_over_old and global_rank() == 0:
        shutil.rmtree(plan.run_dir / "checkpoints", ignore_errors=True)
    if plan.resume is not None and global_rank() == 0:  # the one process that converts
        prune_leftovers(plan.resume.ckpt_dir)


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint --resume continues from, and how it loads: "direct", or "universal" (the
    form `convert` makes for this layout)."""
    ckpt_dir: Path
    tag: str
    step: int
    consumed_samples: int
    mode: str
    target: TargetLayout     # the resumed run's layout (its universal form is made for it)
    earlier: tuple = ()      # older candidates, newest first, should this one prove damaged


def plan_resume(run_dir: Path, topo, deepspeed, signature: dict, vocab_known: bool
                ) -> ResumePlan:
    """`deepspeed`: the plan's config/ds_config.DeepSpeedView; `signature`: the config's
    ModelShape.weights_signature(), its vocabulary the run's where `vocab_known`."""
    ckpt_dir = run_dir / "checkpoints"
    tags = candidates(ckpt_dir)
    plan = plan_for_tag(ckpt_dir, tags[0], topo, deepspeed)
    refuse_other_shape(ckpt_dir / plan.tag, saved_model(ckpt_dir / plan.tag), signature,
                       unknown=() if vocab_known else ("vocab_size",))
    return dataclasses.replace(plan, earlier=tuple(tags[1:]))


def plan_for_tag(ckpt_dir: Path, tag: str, topo, deepspeed) -> ResumePlan:
    saved = saved_optimizer(ckpt_dir / tag)
    if saved != deepspeed.optimizer:
        raise DrScaleError(f"{ckpt_dir / tag}: holds the state of optimizer {saved}, and this "
                           f"run's is {deepspeed.optimizer} ({deepspeed.source}, train.optimizer); "
                           f"resume with {saved}, or start from the weights alone through "
                           f"`dr-scale export` and model.init_from")
    target = TargetLayout.of(topo, deepspeed.stage)
    mode = reshard_plan(ckpt_dir, tag, target,
                        target_nvme="offload_optimizer" in deepspeed.nvme_sections,
                        sub_group_size=dsc.sub_group_size(deepspeed.filled))
    step, consumed = saved_position(ckpt_dir / tag)
    return ResumePlan(ckpt_dir, tag, step, consumed, mode, target)


def candidates(ckpt_dir: Path) -> list:
    """The checkpoints a resume may continue from, newest first: the latest and those before
    it whose folder holds every file its manifest lists (one listing each), whose trainer state
    reads, and that no earlier resume found damaged. Rank 0 says which it skipped and why, one
    line each. Sizes and checksums are checked once the ranks can share the reading
    (checkpoint/agree.py); every rank walks the same list, so all plan the same one."""
    latest = latest_tag(ckpt_dir)
    if latest is None:
        find_tag(ckpt_dir)  # its one line: no checkpoint at all
    tags = complete_tags(ckpt_dir)
    skipped = [] if latest in tags else [(latest, f"{LATEST} names it, but its folder is gone")]
    found = []
    for tag in [t for t in reversed(tags) if step_of(t) <= step_of(latest)]:
        body, fault = manifest.read_for_resume(ckpt_dir / tag)
        if fault is None and body is not None:
            present = set(os.listdir(ckpt_dir / tag))
            missing = sorted(n for n in body["files"] if n.split("/")[0] not in present)
            fault = missing and f"{missing[0]} is missing"
        if not fault:
            try:
                saved_position(ckpt_dir / tag)
            except DrScaleError as e:
                fault = str(e)
        if fault:
            skipped.append((tag, fault))
        else:
            found.append(tag)
    if not found:
        raise no_intact(ckpt_dir, skipped)
    say_skipped(ckpt_dir, [(t, why) for t, why in skipped if step_of(t) > step_of(found[0])],
                found[0])
    return found


def no_intact(ckpt_dir: Path, skipped: list) -> DrScaleError:
    """The one line when every checkpoint in `skipped` ((tag, why), newest first) is not
    intact."""
    return DrScaleError(f"{ckpt_dir}: no intact checkpoint: {skipped[0][0]}: {skipped[0][1]}"
                        + (f" (and {len(skipped) - 1} older one(s) not intact either; "
                           f"`dr-scale verify --run_dir {ckpt_dir.parent}` lists them)"
                           if len(skipped) > 1 else ""))


def say_skipped(ckpt_dir: Path, skipped: list, tag: str):
    """Global rank 0's warning for each newer checkpoint passed over for `tag`."""
    for bad, why in skipped if global_rank() == 0 else ():
        warn(f"{ckpt_dir / bad}: not intact ({why}); resuming from {tag}")


def convert(plan: ResumePlan, timeout_s: int):
    """--resume on another number of ranks or ZeRO family: the checkpoint is converted to
    DeepSpeed's universal format by global rank 0 while the others wait for its output on the
    shared file system (no collective is open, so none times out on the conversion; a wait
    ends when the conversion stops making progress for `timeout_s`)."""
    ckpt_dir, tag, target = plan.ckpt_dir, plan.tag, plan.target
    if plan.mode != "universal" or universal_ready(ckpt_dir, tag, target):
        return
    if global_rank() == 0:
        print(f"dr_scale: resharding {ckpt_dir / tag} for {target.world} rank(s) at "
              f"ZeRO-{target.stage} (DeepSpeed universal checkpoint; `dr-scale reshard` does "
              f"this ahead of a job)", flush=True)
        t0 = time.time()
        convert_to_universal(ckpt_dir, tag, target)
        print(f"dr_scale: resharded in {time.time() - t0:.1f} s", flush=True)
    else:
        wait_for_universal(ckpt_dir, tag, target, stall_s=timeout_s)
