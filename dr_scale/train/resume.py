"""Resuming a run folder: `--resume auto` settled, the checkpoint to continue from and how it
loads (directly, or converted once to DeepSpeed's universal form before the process group), and
the run folder itself."""
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dr_scale.runtime import comm, nvme_offload
from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.train.checkpoint import complete_tags, find_tag, saved_position
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


def plan_resume(run_dir: Path, topo, ds: dict) -> ResumePlan:
    ckpt_dir = run_dir / "checkpoints"
    tag = find_tag(ckpt_dir)
    stage = dsc.zero_stage(ds)
    mode = reshard_plan(ckpt_dir, tag, topo.world, stage, topo.tensor, topo.pipeline,
                        target_nvme=nvme_offload.optimizer_on_nvme(ds),
                        sub_group_size=dsc.sub_group_size(ds))
    step, consumed = saved_position(ckpt_dir / tag)
    return ResumePlan(ckpt_dir, tag, step, consumed, mode, stage)


def convert_before_group(plan: ResumePlan, world: int, timeout_s: int):
    """--resume on another number of ranks or ZeRO family: the checkpoint is converted to
    DeepSpeed's universal format before the process group exists, by global rank 0 (the others
    wait for its output on the shared file system), so no collective waits on the conversion."""
    ckpt_dir, tag, stage = plan.ckpt_dir, plan.tag, plan.zero_stage
    if plan.mode != "universal" or universal_ready(ckpt_dir, tag, stage, world):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"dr_scale: resharding {ckpt_dir / tag} for {world} rank(s) at ZeRO-{stage} "
              f"(DeepSpeed universal checkpoint; `dr-scale reshard` does this ahead of a job)",
              flush=True)
        t0 = time.time()
        convert_to_universal(ckpt_dir, tag, stage, world)
        print(f"dr_scale: resharded in {time.time() - t0:.1f} s", flush=True)
    else:
        wait_for_universal(ckpt_dir, tag, stage, world, stall_s=timeout_s)
