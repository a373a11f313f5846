"""The run as a plan: `check(args)` reads the command line, the experiment config and the
DeepSpeed JSON, makes every refusal and the memory check, and returns one frozen RunPlan, before
any process group exists. Each step of the run after it (dr_scale/launch.py) takes the plan and
adds only what needs ranks; nothing here is computed again.

What the plan cannot hold is what the ranks make: the run folder's default name (one timestamp
for all ranks), the tokenizer of the bundled corpus (built by each node's first rank), and so the
vocabulary (`RunPlan.shape` has the config's; the data step settles it).
"""
import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from dr_scale.config import ds_config as dsc
from dr_scale.runtime import nvme_offload, op_builds
from dr_scale.callbacks.build import build_callbacks
from dr_scale.config import load_config
from dr_scale.data.loader import dataset_types
from dr_scale.runtime.process_group import init_distributed, world_size_from_env
from dr_scale.errors import DrScaleError
from dr_scale.export.hf import apply_init_from
from dr_scale.runtime.hardware import bf16_support
from dr_scale.models import resolve_shape
from dr_scale.models.build import ModelShape
from dr_scale.parallel import memory_guard
from dr_scale.parallel import parallelize as par
from dr_scale.parallel.topology import Topology
from dr_scale.train import hangs
from dr_scale.train.resume import (ResumePlan, choose_run_dir, convert_before_group, plan_resume,
                                  settle_resume)


@dataclass(frozen=True)
class RunPlan:
    cfg: Any                      # the RunConfig, frozen
    ds_path: Path                 # the DeepSpeed JSON given
    raw_ds: dict                  # as written
    ds: dict                      # every "auto" filled for this machine's device
    precision: str                # fp32 | bf16 | fp16
    bf16: Any                     # hardware.Bf16Support: why bf16 "auto" chose what it chose
    device_type: str              # cuda | cpu
    topology: Topology            # rank-less: sizes and layout rules
    shape: ModelShape             # the config's shape (the data step settles the vocabulary)
    callbacks: List[Any]          # built and checked
    run_dir: Optional[Path]       # as given (None: the ranks choose a timestamped one)
    resume: Optional[ResumePlan]  # with --resume
    fresh_over_old: bool          # a fresh start in a run folder that never saved
    init_weights: Any = None      # model.init_from's weights (located, not read)
    stop_at_step: Optional[int] = None


def check(args) -> RunPlan:
    """Everything a config can get wrong, before the process group; see the module's text."""
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one machine's folder: one rank says it
        for line in op_builds.lock_warnings():
            sys.stderr.write(f"dr_scale: warning: {line}\n")  # one write: one line (launch.say)
            sys.stderr.flush()
    fresh_over_old = settle_resume(args)
    cfg, run_dir, init_weights = load_run_config(args)
    ds_path = dsc.resolve_path(args.ds_config)
    raw_ds = dsc.read_json(ds_path)
    topo = Topology.from_config(world_size_from_env(), cfg.parallel)
    shape = resolve_shape(cfg.model)  # unknown preset, indivisible heads, attention name
    if cfg.data.seq_length > shape.max_seq_length:
        raise DrScaleError(f"data.seq_length={cfg.data.seq_length} exceeds "
                           f"model.max_seq_length={shape.max_seq_length}")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = bf16_support(device_type)
    ds = dsc.fill(raw_ds, cfg, topo.data, source=str(ds_path), bf16_native=bf16.native,
                  device_type=device_type)
    par.refusals(shape, topo, cfg, ds, ds_path)
    nvme_offload.check_system(ds, str(ds_path))
    callbacks = build_callbacks(cfg.callbacks, topo)
    dataset_types(cfg.data)
    if not args.skip_memory_check:  # before any rank allocates the model
        memory_guard.refuse_if_too_big(cfg, ds, topo, device_type, str(ds_path), shape)
    resume = None
    if args.resume:
        resume = plan_resume(run_dir.resolve(), topo, ds, cfg.train.collective_timeout_s)
        convert_before_group(resume, topo.world, cfg.train.collective_timeout_s)
    cfg.freeze()
    return RunPlan(cfg, ds_path, raw_ds, ds, dsc.precision(ds), bf16, device_type, topo, shape,
                   callbacks, run_dir, resume, fresh_over_old, init_weights, args.stop_at_step)


@dataclass(frozen=True)
class Group:
    """What the process group adds to the plan: this rank's place, its device, the run folder
    (one name for all ranks), the DeepSpeed config with its NVMe paths there."""
    topology: Topology
    device: torch.device
    local_world: int
    run_dir: Path
    ds: dict
    batch_sizes: dict  # micro-batch, accumulation, global batch


def start_group(plan: RunPlan) -> Group:
    hangs.configure(plan.cfg.train.collective_timeout_s)
    device, local_world = init_distributed(plan.cfg.train.collective_timeout_s)
    topo = Topology.from_config(plan.topology.world, plan.cfg.parallel,
                                dist.get_rank()).with_groups()
    run_dir = choose_run_dir(plan.run_dir, plan.cfg, plan.resume is not None)
    ds = copy.deepcopy(plan.ds)
    nvme_offload.fill_paths(ds, run_dir, raw=plan.raw_ds)
    if plan.resume is not None and plan.resume.mode == "universal":
        ds["checkpoint"] = dict(ds.get("checkpoint", {}), load_universal=True)
    return Group(topo, device, local_world, run_dir, ds, dsc.batch_sizes(plan.cfg.train, topo.data))


def load_run_config(args):
    """(config, run folder or None, weights of model.init_from or None): --resume without
    --config reads the run's own config; model.init_from's folder decides the shape."""
    run_dir = Path(args.run_dir) if args.run_dir else None
    config_path = args.config
    if args.resume:
        if run_dir is None:
            raise DrScaleError("--resume: needs --run_dir (the run folder to continue)")
        if config_path is None:
            config_path = run_dir / "config.yaml"
            if not config_path.is_file():
                raise DrScaleError(f"{config_path}: not found; --resume continues a run folder "
                                   "made by an earlier run")
    if args.stop_at_step is not None and args.stop_at_step < 1:
        raise DrScaleError(f"--stop_at_step {args.stop_at_step}: expected a step >= 1")
    cfg = load_config(config_path, args.overrides)
    init_weights = apply_init_from(cfg) if cfg.model.init_from else None
    return cfg, run_dir, init_weights
