"""Resuming a run folder: `--resume auto` settled, the checkpoint to continue from and how it
loads (directly, or converted once to DeepSpeed's universal form before the process group), and
the run folder itself."""
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
                                        saved_position, step_of)
from dr_scale.checkpoint.reshard import (convert_to_universal, prune_leftovers, reshard_plan,
                                         universal_ready, wait_for_universal)

# What marks a folder as a run folder (--resume auto starts fresh only in one of these or none)
RUN_FILES = ("config.yaml", "run.json", "metrics.jsonl", "checkpoints", "ds_config.json")


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
    leftovers cleared, and the checkpoint to resume converted to the universal form where the
    layout changed. Global rank 0 writes (the run folder is shared); the others wait only for
    the conversion, on the file system."""
    if plan.fresh_over_old and global_rank() == 0:
        shutil.rmtree(plan.run_dir / "checkpoints", ignore_errors=True)
    if plan.resume is not None and global_rank() == 0:  # the one process that converts
        prune_leftovers(plan.resume.ckpt_dir)
    if plan.resume is not None:
        convert_before_group(plan.resume, plan.cfg.train.collective_timeout_s)


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint --resume continues from, and how it loads: "direct", or "universal" (the
    form `convert_before_group` makes for this layout)."""
    ckpt_dir: Path
    tag: str
    step: int
    consumed_samples: int
    mode: str
    target: TargetLayout     # the resumed run's layout (its universal form is made for it)


def plan_resume(run_dir: Path, topo, deepspeed, signature: dict, vocab_known: bool,
                timeout_s: int = 600) -> ResumePlan:
    """`deepspeed`: the plan's config/ds_config.DeepSpeedView; `signature`: the config's
    ModelShape.weights_signature(), its vocabulary the run's where `vocab_known`."""
    ckpt_dir = run_dir / "checkpoints"
    tag = newest_intact(ckpt_dir, timeout_s)
    refuse_other_shape(ckpt_dir / tag, saved_model(ckpt_dir / tag), signature,
                       unknown=() if vocab_known else ("vocab_size",))
    target = TargetLayout.of(topo, deepspeed.stage)
    mode = reshard_plan(ckpt_dir, tag, target,
                        target_nvme="offload_optimizer" in deepspeed.nvme_sections,
                        sub_group_size=dsc.sub_group_size(deepspeed.filled))
    step, consumed = saved_position(ckpt_dir / tag)
    return ResumePlan(ckpt_dir, tag, step, consumed, mode, target)


def newest_intact(ckpt_dir: Path, timeout_s: int) -> str:
    """The checkpoint to resume from: the latest, or, when its manifest shows it incomplete or
    damaged, or its folder is gone (a save that replaced it was killed between its renames),
    the newest one before it that is intact (rank 0 says which it skipped and why, one line
    each). Sizes are compared by every rank, checksums by global rank 0 (manifest.py); every
    rank walks the same list in the same order, so all arrive at the same checkpoint."""
    latest = latest_tag(ckpt_dir)
    if latest is None:
        find_tag(ckpt_dir)  # its one line: no checkpoint at all
    rank0 = global_rank() == 0
    tags = complete_tags(ckpt_dir)
    candidates = [t for t in reversed(tags) if step_of(t) <= step_of(latest)]
    skipped = [] if latest in tags else [(latest, f"{LATEST} names it, but its folder is gone")]
    for tag in candidates:
        fault = (manifest.verify(ckpt_dir / tag) if rank0
                 else manifest.wait_for_verdict(ckpt_dir / tag, timeout_s))
        if fault is None:
            for bad, why in skipped if rank0 else ():
                warn(f"{ckpt_dir / bad}: not intact ({why}); resuming from {tag}")
            return tag
        skipped.append((tag, fault))
    raise DrScaleError(f"{ckpt_dir}: no intact checkpoint: {skipped[0][0]}: {skipped[0][1]}"
                       + (f" (and {len(skipped) - 1} older one(s) not intact either; `dr-scale "
                          f"verify --run_dir {ckpt_dir.parent}` lists them)"
                          if len(skipped) > 1 else ""))


def convert_before_group(plan: ResumePlan, timeout_s: int):
    """--resume on another number of ranks or ZeRO family: the checkpoint is converted to
    DeepSpeed's universal format before the process group exists, by global rank 0 (the others
    wait for its output on the shared file system), so no collective waits on the conversion."""
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
