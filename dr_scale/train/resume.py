"""Resuming a run folder: `--resume auto` settled, the checkpoint to continue from and how it
loads (directly, or converted once to DeepSpeed's universal form before the process group), and
the run folder itself."""
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dr_scale.runtime import comm, nvme_offload
from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.train import manifest
from dr_scale.train.checkpoint import complete_tags, find_tag, saved_position, step_of
from dr_scale.train.reshard import (convert_to_universal, reshard_plan, universal_ready,
                                    wait_for_universal)

# What marks a folder as a run folder (--resume auto starts fresh only in one of these or none)
RUN_FILES = ("config.yaml", "run.json", "metrics.jsonl", "checkpoints", "ds_config.json")


def settle_resume(args):
    """Turn --resume auto into yes or no, before anything reads the run folder: yes when it holds
    a complete checkpoint; no when it is absent, empty, or a run folder without one (a run that
    stopped before its first save: its records are set aside). Returns whether a fresh start
    reuses such a folder."""
    if args.resume != "auto":
        args.resume = args.resume is not None
        return False
    if not args.run_dir:
        raise DrScaleError("--resume auto: needs --run_dir (the folder to continue or start)")
    run_dir = Path(args.run_dir)
    if complete_tags(run_dir / "checkpoints"):
        args.resume = True
        return False
    args.resume = False
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return False
    if not any((run_dir / name).exists() for name in RUN_FILES):
        raise DrScaleError(f"{run_dir}: --resume auto: not a dr_scale run folder (none of "
                           f"{', '.join(RUN_FILES)}); choose another --run_dir")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # staging leftovers only
    return True


def choose_run_dir(run_dir, cfg, resume: bool) -> Path:
    if run_dir is None:  # one timestamp for all ranks
        run_dir = Path(cfg.run_dir or comm.broadcast_object(time.strftime("runs/%Y%m%d-%H%M%S")))
    run_dir = run_dir.resolve()
    if not resume and (run_dir / "checkpoints").exists():
        raise DrScaleError(f"{run_dir}: already holds checkpoints; pass --resume to continue it, "
                           "or choose another --run_dir")
    return run_dir


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint --resume continues from, and how it loads: "direct", or "universal" (the
    form `convert_before_group` makes for this layout)."""
    ckpt_dir: Path
    tag: str
    step: int
    consumed_samples: int
    mode: str
    zero_stage: int
    pipelined: bool = False  # the resumed run's (its universal form is named for a pipeline)
    expert: int = 1          # the resumed run's expert-parallel size (its own optimizer groups)


def plan_resume(run_dir: Path, topo, ds: dict, timeout_s: int = 600) -> ResumePlan:
    ckpt_dir = run_dir / "checkpoints"
    tag = newest_intact(ckpt_dir, timeout_s)
    stage = dsc.zero_stage(ds)
    mode = reshard_plan(ckpt_dir, tag, topo.world, stage, topo.tensor, topo.pipeline,
                        target_nvme=nvme_offload.optimizer_on_nvme(ds),
                        sub_group_size=dsc.sub_group_size(ds), expert=topo.expert)
    step, consumed = saved_position(ckpt_dir / tag)
    return ResumePlan(ckpt_dir, tag, step, consumed, mode, stage, topo.pipelined, topo.expert)


def newest_intact(ckpt_dir: Path, timeout_s: int) -> str:
    """The checkpoint to resume from: the latest, or, when its manifest shows it incomplete or
    damaged, the newest one before it that is intact (rank 0 says which it skipped and why, one
    line each). Sizes are compared by every rank, checksums by global rank 0 (manifest.py); every
    rank walks the same list in the same order, so all arrive at the same checkpoint."""
    latest = find_tag(ckpt_dir)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    candidates = [t for t in reversed(complete_tags(ckpt_dir)) if step_of(t) <= step_of(latest)]
    skipped = []
    for tag in candidates:
        fault = (manifest.verify(ckpt_dir / tag) if rank0
                 else manifest.wait_for_verdict(ckpt_dir / tag, timeout_s))
        if fault is None:
            for bad, why in skipped if rank0 else ():
                sys.stderr.write(f"dr_scale: warning: {ckpt_dir / bad}: not intact ({why}); "
                                 f"resuming from {tag}\n")
                sys.stderr.flush()
            return tag
        skipped.append((tag, fault))
    raise DrScaleError(f"{ckpt_dir}: no intact checkpoint: {skipped[0][0]}: {skipped[0][1]}"
                       + (f" (and {len(skipped) - 1} older one(s) not intact either; `dr-scale "
                          f"verify --run_dir {ckpt_dir.parent}` lists them)"
                          if len(skipped) > 1 else ""))


def convert_before_group(plan: ResumePlan, world: int, timeout_s: int):
    """--resume on another number of ranks or ZeRO family: the checkpoint is converted to
    DeepSpeed's universal format before the process group exists, by global rank 0 (the others
    wait for its output on the shared file system), so no collective waits on the conversion."""
    ckpt_dir, tag, stage, pipelined = plan.ckpt_dir, plan.tag, plan.zero_stage, plan.pipelined
    expert = plan.expert
    if plan.mode != "universal" or universal_ready(ckpt_dir, tag, stage, world, pipelined,
                                                   expert):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"dr_scale: resharding {ckpt_dir / tag} for {world} rank(s) at ZeRO-{stage} "
              f"(DeepSpeed universal checkpoint; `dr-scale reshard` does this ahead of a job)",
              flush=True)
        t0 = time.time()
        convert_to_universal(ckpt_dir, tag, stage, world, pipelined=pipelined, expert=expert)
        print(f"dr_scale: resharded in {time.time() - t0:.1f} s", flush=True)
    else:
        wait_for_universal(ckpt_dir, tag, stage, world, stall_s=timeout_s, pipelined=pipelined,
                           expert=expert)
