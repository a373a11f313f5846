"""The run as a plan: `check(args)` reads the command line, the experiment config and the
DeepSpeed JSON, makes every refusal and the memory check, and returns one frozen RunPlan, before
any process group exists, writing nothing (the steps that write come after it: `prepare_files`
in checkpoint/resume.py, then the process group). Each step of the run after it (dr_scale/launch.py)
takes the plan and adds only what needs ranks; nothing here is computed again.

What the plan cannot hold is what the ranks make: the run folder's default name (one timestamp
for all ranks), the tokenizer of the bundled corpus (built by each node's first rank), and so its
vocabulary (`RunPlan.shape` has a named tokenizer's, else the config's; the data step settles
it).
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from dr_scale.config import ds_config as dsc
from dr_scale.runtime import node_memory, nvme_offload, op_builds
from dr_scale.runtime.ranks import local_rank, warn
from dr_scale.callbacks.build import build_callbacks
from dr_scale.config import load_config
from dr_scale.data.loader import check_eval_share
from dr_scale.data.prepare import DataPlan, plan_data
from dr_scale.runtime.process_group import init_distributed, world_size_from_env
from dr_scale.errors import DrScaleError
from dr_scale.export.hf import apply_init_from
from dr_scale.runtime.hardware import bf16_support
from dr_scale.models import resolve_shape
from dr_scale.models.build import ModelShape, vocab_for
from dr_scale.models.kernel_choice import check_kernels
from dr_scale.parallel import memory_guard
from dr_scale.parallel import parallelize as par
from dr_scale.parallel.tensor import autotp_section
from dr_scale.parallel.topology import Topology
from dr_scale.runtime import hangs
from dr_scale.train.engine import check_precision, check_with_deepspeed
from dr_scale.checkpoint.resume import (ResumePlan, default_run_dir, plan_resume,
                                  refuse_old_checkpoints, resume_decision)
from dr_scale.train.schedule import check_schedule


@dataclass(frozen=True)
class RunPlan:
    cfg: Any                      # the RunConfig, frozen
    deepspeed: dsc.DeepSpeedView  # the DeepSpeed JSON as written and filled; stage, precision...
    device_type: str              # cuda | cpu
    topology: Topology            # rank-less: sizes and layout rules
    shape: ModelShape             # the config's; its vocabulary the named tokenizer's, else the
                                  # data step settles it
    data: DataPlan                # the named tokenizer (loaded) and datasets, checked
    callbacks: List[Any]          # built and checked
    run_dir: Optional[Path]       # resolved (None: the ranks choose a timestamped one)
    resume: Optional[ResumePlan]  # with --resume
    fresh_over_old: bool          # a fresh start in a run folder that never saved
    init_weights: Any = None      # model.init_from's weights (located, not read)
    stop_at_step: Optional[int] = None


def check(args) -> RunPlan:
    """Everything a config can get wrong, before the process group, writing nothing; see the
    module's text. To add a refusal: raise DrScaleError (one line: file, key, what was expected)
    from the check of the section it concerns, called here."""
    if local_rank() == 0:  # one machine's folder: one rank says it
        for line in op_builds.lock_warnings():
            warn(line)
    resume, fresh_over_old = resume_decision(args)
    cfg, run_dir, init_weights = load_run_config(args, resume)
    refuse_old_checkpoints(run_dir, resume, fresh_over_old)
    topo = Topology.from_config(world_size_from_env(), cfg.parallel)
    shape = resolve_shape(cfg.model)  # unknown preset, indivisible heads, attention name
    if cfg.data.seq_length > shape.max_seq_length:
        raise DrScaleError(f"data.seq_length={cfg.data.seq_length} exceeds "
                           f"model.max_seq_length={shape.max_seq_length}")
    check_schedule(cfg.train)
    check_eval_share(cfg.train.eval_samples, topo.data)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    deepspeed = deepspeed_view(args.ds_config, cfg, topo, shape, device_type)
    par.refusals(shape, topo, cfg, deepspeed)
    check_kernels(shape, cfg, device_type, deepspeed.precision)
    nvme_offload.check_system(deepspeed.filled, deepspeed.source)
    callbacks = build_callbacks(cfg.callbacks, topo, deepspeed.optimizer)
    data = plan_data(cfg.data, run_dir if resume else None)
    if data.vocab_size is not None:  # a model.vocab_size smaller than the tokenizer's
        shape = dataclasses.replace(shape, vocab_size=vocab_for(cfg.model, data.vocab_size))
    if not args.skip_memory_check:  # before any rank allocates the model
        memory_guard.refuse_if_too_big(cfg, deepspeed.filled, topo, device_type,
                                       deepspeed.source, shape, vocab=data.vocab_size)
    resume_plan = None
    if resume:
        resume_plan = plan_resume(run_dir, topo, deepspeed, shape.weights_signature(),
                                  data.vocab_size is not None or cfg.model.vocab_size is not None)
        if resume_plan.mode == "universal":
            deepspeed = dataclasses.replace(deepspeed, filled=dict(
                deepspeed.filled, checkpoint=dict(deepspeed.filled.get("checkpoint", {}),
                                                  load_universal=True)))
    cfg.freeze()
    return RunPlan(cfg, deepspeed, device_type, topo, shape, data, callbacks, run_dir,
                   resume_plan, fresh_over_old, init_weights, args.stop_at_step)


def deepspeed_view(name_or_path: str, cfg, topo: Topology, shape, device_type: str,
                   bf16=None) -> dsc.DeepSpeedView:
    """The DeepSpeed JSON read, filled for this machine and checked; AutoTP's section added
    under tensor parallelism without a pipeline. `bf16`: what decides bf16 "auto" (default:
    this machine's runtime.hardware.bf16_support)."""
    path = dsc.resolve_path(name_or_path)
    raw = dsc.read_json(path)
    bf16 = bf16 or bf16_support(device_type)
    batch = dsc.batch_sizes(cfg.train, topo.data)
    filled = dsc.fill(raw, cfg, topo.data, source=str(path), bf16_native=bf16.native,
                      device_type=device_type, batch=batch)
    check_precision(dsc.precision(filled), path)
    if topo.autotp:
        filled["tensor_parallel"] = autotp_section(shape, topo.tensor,
                                                   cfg.parallel.vocab_parallel)
    check_with_deepspeed(filled, path)
    return dsc.DeepSpeedView(path, raw, filled, batch, bf16)


@dataclass(frozen=True)
class Group:
    """What the process group adds to the plan: this rank's place, its device, the run folder
    (one name for all ranks), the DeepSpeed config the engine gets (its NVMe paths there)."""
    topology: Topology
    device: torch.device
    local_world: int
    run_dir: Path
    ds: dict


def start_group(plan: RunPlan) -> Group:
    hangs.configure(plan.cfg.train.collective_timeout_s)
    device, local_world = init_distributed(plan.cfg.train.collective_timeout_s)
    node_memory.forget()  # every rank has planned: the node's memory figure is not needed
    topo = plan.topology.at_rank(dist.get_rank()).with_groups()
    run_dir = plan.run_dir or default_run_dir()
    return Group(topo, device, local_world, run_dir, plan.deepspeed.for_run(run_dir))


def load_run_config(args, resume: bool):
    """(config, run folder resolved or None, weights of model.init_from or None): --resume
    without --config reads the run's own config; model.init_from's folder decides the shape."""
    run_dir = Path(args.run_dir) if args.run_dir else None
    config_path = args.config
    if resume:
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
    if run_dir is None and cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    return cfg, run_dir and run_dir.resolve(), init_weights
