"""`deepspeed launchers/pretrain.py --ds_config zero3.json [--config Y] [--run_dir D] [--resume]
[dotted.key=value ...]`: config -> data -> model -> DeepSpeed engine -> Trainer.fit()."""
import argparse
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dr_scale import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.config.snapshot import write_snapshot
from dr_scale.errors import DrScaleError, TrainingStopped
from dr_scale.hardware import bf16_support
from dr_scale.parallel.tensor import autotp_section
from dr_scale.parallel.topology import Topology

USAGE = ("deepspeed launchers/pretrain.py --ds_config NAME_OR_PATH [--config YAML] "
         "[--run_dir DIR] [--resume] [--stop_at_step N] [dotted.key=value ...]")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise DrScaleError(f"command line: {message} (usage: {USAGE})")


def parse_args(argv=None):
    p = _Parser(prog="pretrain.py", usage=USAGE)
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON; bare names resolve to ds_configs/")
    p.add_argument("--config", help="experiment YAML; default: the embedded default")
    p.add_argument("--run_dir", help="run folder; default: runs/<date>-<time>")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--stop_at_step", type=int, default=None, metavar="N",
                   help="save and exit after step N (the schedule still runs to train.max_steps)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed():
    """deepspeed.init_distributed with the accelerator's backend (gloo on CPU, NCCL on GPU); a
    plain `python launchers/pretrain.py` becomes a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    if acc.device_name() == "cpu":
        release_shm_names()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or
                      os.environ.get("WORLD_SIZE", "1"))
    if acc.device_name() == "cpu":
        # Ranks share the cores: more threads than cores per rank makes gloo steps erratic.
        threads = int(os.environ.get("DR_SCALE_THREADS_PER_RANK", 0)) or \
            max(1, (os.cpu_count() or 1) // max(1, local_world))
        torch.set_num_threads(threads)
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        acc.set_device(local_rank)
        device = torch.device(acc.device_name(local_rank))
    return device, local_world


def release_shm_names():
    """DeepSpeed's CPU comm op maps a 66 MB /dev/shm buffer per rank (for inference all-reduce)
    and never unlinks it, so every run used to leave its buffers behind until /dev/shm filled
    and later runs crashed or hung. Once every rank has mapped its peers' buffers (the barrier),
    the names can go: the mappings live on and the memory is freed when the ranks exit, SIGKILL
    included."""
    import glob

    dist.barrier()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass
    dist.barrier()


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_run_config(args):
    """(config, run folder or None): --resume without --config reads the run's own config."""
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
    return load_config(config_path, args.overrides), run_dir


def choose_run_dir(run_dir, cfg, resume: bool) -> Path:
    if run_dir is None:  # one timestamp for all ranks
        run_dir = Path(cfg.run_dir or _broadcast(time.strftime("runs/%Y%m%d-%H%M%S")))
    run_dir = run_dir.resolve()
    if not resume and (run_dir / "checkpoints").exists():
        raise DrScaleError(f"{run_dir}: already holds checkpoints; pass --resume to continue it, "
                           "or choose another --run_dir")
    return run_dir


def prepare_data(cfg, layout):
    """Tokenizer + train/held-out streams; local rank 0 builds the first-use cache alone."""
    from dr_scale.data.loader import build_sources, resolve_files

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    files = resolve_files(cfg.data) if local_rank == 0 else None
    dist.barrier()
    if files is None:
        files = resolve_files(cfg.data)
    t = cfg.train
    return build_sources(cfg.data, t.seed, train_samples=t.max_steps * layout["global"],
                         eval_samples=t.eval_samples, tokenizer_path=files[0], specs=files[1])


def plan_resume(ckpt_dir: Path, world: int, ds: dict, topo: Topology):
    """(step, plan) for --resume; with another number of ranks or ZeRO stage, rank 0 converts the
    checkpoint to DeepSpeed's universal format first (once) and every rank loads that."""
    from dr_scale.train.checkpoint import (convert_to_universal, find_tag, reshard_plan,
                                           step_of)

    tag = find_tag(ckpt_dir)
    plan = reshard_plan(ckpt_dir, tag, world, dsc.zero_stage(ds), topo.tensor, topo.pipeline)
    if plan == "universal":
        if dist.get_rank() == 0:
            print(f"dr_scale: resharding {ckpt_dir / tag} for {world} rank(s) at ZeRO-"
                  f"{dsc.zero_stage(ds)} (DeepSpeed universal checkpoint)", flush=True)
            convert_to_universal(ckpt_dir, tag, dsc.zero_stage(ds), world)
        dist.barrier()
    return step_of(tag), plan


def check_same_tokenizer(run_dir: Path, tokenizer, given: str):
    from dr_scale.data.tokenizer import file_sha256

    used = run_dir / "tokenizer.model"
    if used.is_file() and file_sha256(used) != tokenizer.sha256:
        raise DrScaleError(f"{used}: the run was trained with this tokenizer, but the resumed "
                           f"config gives {given}; token ids would change meaning")


def param_groups(model, weight_decay: float):
    """No weight decay on vectors (norm weights, biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def run(args):
    import deepspeed

    from dr_scale.models import build_model, resolve_shape
    from dr_scale.models.build import (count_parameters, flops_per_token,
                                       recompute_flops_per_token)
    from dr_scale.callbacks.build import build_callbacks
    from dr_scale.train.metrics import MetricsLogger
    from dr_scale.train.peak_flops import peak_flops
    from dr_scale.train.schedule import build_scheduler
    from dr_scale.train.trainer import Trainer

    cfg, run_dir = load_run_config(args)
    init_state = None
    if cfg.model.init_from:
        from dr_scale.export.hf_llama import apply_init_from

        init_state = apply_init_from(cfg)  # shape and tokenizer come from the folder
    ds_path = dsc.resolve_path(args.ds_config)  # a bad name fails before the slow start below

    device, local_world = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology(world, cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel)
    raw_ds = dsc.read_json(ds_path)
    check_pipeline(topo, dsc.zero_stage(raw_ds), ds_path)
    dp_size, dp_rank = topo.data, topo.coords(rank)["data"]  # a TP group reads the same batches
    bf16 = bf16_support(device.type)
    ds = dsc.fill(raw_ds, cfg, dp_size, source=str(ds_path), bf16_native=bf16.native)
    precision_why, precision_warning = dsc.bf16_choice(raw_ds, bf16, str(ds_path))
    layout = dsc.batch_layout(cfg.train, dp_size)
    check_precision(ds, ds_path)
    run_dir = choose_run_dir(run_dir, cfg, args.resume)
    resume_step, resume_plan = None, None
    if args.resume:
        resume_step, resume_plan = plan_resume(run_dir / "checkpoints", world, ds, topo)
        if resume_plan == "universal":
            ds = dict(ds, checkpoint=dict(ds.get("checkpoint", {}), load_universal=True))
    callbacks = build_callbacks(cfg.callbacks, topo.pipeline)

    sources = prepare_data(cfg, layout)
    if args.resume:
        check_same_tokenizer(run_dir, sources.tokenizer,
                             cfg.data.tokenizer or "the tokenizer trained on the bundled corpus")
    shape = resolve_shape(cfg.model, sources.tokenizer.vocab_size)
    if cfg.data.seq_length > shape.max_seq_length:
        raise DrScaleError(f"data.seq_length={cfg.data.seq_length} exceeds "
                           f"model.max_seq_length={shape.max_seq_length}")
    cfg.freeze()
    shape, kernels_line = select_kernels(shape, cfg.model, device.type, dsc.precision(ds))
    if cfg.parallel.sequence_parallel:
        from dr_scale.parallel import sequence

        sequence.check(shape, topo.tensor, cfg.data.seq_length, cfg.parallel.vocab_parallel,
                       topo.pipeline)
    if topo.tensor > 1 and topo.pipeline == 1:  # with a pipeline, applied to its stages below
        ds = dict(ds, tensor_parallel=autotp_section(shape, topo.tensor,
                                                     cfg.parallel.vocab_parallel))

    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(shape)
    if init_state is not None and not args.resume:  # on resume the checkpoint's weights win
        from dr_scale.export.hf_llama import load_into

        load_into(model, init_state, cfg.model.init_from)
    del init_state
    from dr_scale.parallel import checkpointing

    mpu = None
    # DeepSpeed's own (data, tensor) mesh; its batch check then counts DP ranks, and partitioned
    # activations are split over its tensor group
    if topo.tensor > 1 and topo.pipeline == 1:
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=topo.tensor)
        mpu = groups
    checkpointing.apply(model, cfg.parallel.activation_checkpointing, cfg.parallel.checkpoint_every,
                        ds, mpu, source=str(ds_path))
    if cfg.model.compile:
        checkpointing.compile_blocks(model, dsc.zero_stage(ds), cfg.parallel.activation_checkpointing)
    n_params = count_parameters(model)
    fpt = flops_per_token(shape, cfg.data.seq_length)
    hw_fpt = fpt + recompute_flops_per_token(shape, cfg.data.seq_length,
                                             cfg.parallel.activation_checkpointing,
                                             cfg.parallel.checkpoint_every)
    precision = dsc.precision(ds)
    peak, peak_source = peak_flops(precision, device.type,
                                   torch.cuda.get_device_name() if device.type == "cuda" else "")

    if rank == 0:
        snap_dir = run_dir / "resumes" / time.strftime("%Y%m%d-%H%M%S") if args.resume else run_dir
        write_snapshot(snap_dir, cfg, ds, {
            "world": {"world_size": world, "ranks_per_node": local_world, "data_parallel": dp_size,
                      "tensor_parallel": topo.tensor, "pipeline_parallel": topo.pipeline,
                      "device": device.type, "backend": dist.get_backend()},
            "model": {"shape": shape.__dict__, "parameters": n_params, "flops_per_token": fpt,
                      "hardware_flops_per_token": hw_fpt},
            "data": {"tokenizer": str(sources.tokenizer.path),
                     "tokenizer_sha256": sources.tokenizer.sha256,
                     "datasets": [{"prefix": d.indexed.prefix, "weight": float(w)}
                                  for d, w in zip(sources.train.datasets, sources.train.weights)]},
            "batch": layout, "peak_flops": {"value": peak, "source": peak_source}})
        if not args.resume:
            shutil.copyfile(sources.tokenizer.path, run_dir / "tokenizer.model")
    dist.barrier()

    logger = MetricsLogger(run_dir, cfg.logging, t.max_steps, enabled=rank == 0,
                           run_name=run_dir.name, resume_step=resume_step)
    logger.info(f"dr_scale: {world} rank(s) ({local_world} on this node), {device.type}, "
                f"{dist.get_backend()}, ZeRO-{dsc.zero_stage(ds)}, {precision}"
                f"{f' ({precision_why})' if precision_why else ''}; model "
                f"{cfg.model.preset} ({shape.arch}) {n_params / 1e6:.2f}M parameters; batch "
                f"{layout['micro']} x {layout['accum']} accumulation x {dp_size} data-parallel = "
                f"{layout['global']} x {cfg.data.seq_length} tokens; run folder {run_dir}")
    if precision_warning:
        logger.info(precision_warning)
    logger.info(f"layout: {topo.describe()}{lm_head_note(topo, cfg.parallel)}; {kernels_line}")

    scheduler = None if "scheduler" in ds else (lambda opt: build_scheduler(opt, t))
    if topo.pipeline > 1:
        from dr_scale.parallel.pipeline import to_pipeline

        model = to_pipeline(model, shape, topo.pipeline, topo.data, topo.tensor)
        if topo.tensor > 1:
            from dr_scale.parallel.tensor import shard_pipeline_stages

            shard_pipeline_stages(model, shape, topo.tensor)
    engine = _initialize_engine(deepspeed, model, param_groups(model, t.weight_decay), ds,
                                scheduler, ds_path, mpu)
    if cfg.parallel.sequence_parallel:  # AutoTP's layers exist only after initialize
        sequence.apply(engine.module, shape.arch)
    trainer = Trainer(engine, cfg, sources, layout, dp_size, dp_rank, run_dir, logger, fpt,
                      peak, device, callbacks, stop_at_step=args.stop_at_step,
                      resume_plan=resume_plan, hardware_flops_per_token=hw_fpt)
    if args.resume:
        trainer.resume()
    try:
        trainer.fit()
    finally:
        logger.close()
    if rank == 0 and cfg.logging.plot:
        from dr_scale.train.plot import plot_curves

        logger.info(f"wrote {plot_curves(run_dir)}")
    close_distributed()
    return run_dir


def close_distributed():
    """Leave the process group together. A rank that exits with gloo's threads still attached
    while its peer is mid-exit can abort in C++ ("terminate called without an active
    exception"), turning a clean stop into a crash code."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def select_kernels(shape, model_cfg, device_type: str, precision: str):
    """Settle `model.attention` (auto: the best available) and every op's implementation for this
    process; returns the shape with a concrete attention name and the line that says the choices."""
    import dataclasses

    from dr_scale.kernels import ops
    from dr_scale.kernels.registry import select

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    unknown = sorted(set(model_cfg.kernels) - set(ops.OPS))
    if unknown:
        raise DrScaleError(f"model.kernels.{unknown[0]}: unknown op; known: {', '.join(ops.OPS)}")
    try:
        line = ops.use_kernels(device_type, dtype, model_cfg.kernels)
    except DrScaleError as e:
        raise DrScaleError(f"model.{e}") from None
    name = shape.attention
    from dr_scale.kernels.registry import KERNELS

    if name != "auto" and name not in KERNELS["attention"]:  # user-registered: used as named
        return shape, f"{line}, attention={name}"
    try:
        kernel = select("attention", device_type, dtype, force=None if name == "auto" else name,
                        head_dim=shape.head_dim)
    except DrScaleError as e:
        raise DrScaleError(f"model.attention: {str(e).split(': ', 1)[-1]}") from None
    shape = dataclasses.replace(shape, attention=kernel.name)
    return shape, f"{line}, attention={kernel.name}"


def lm_head_note(topo, parallel_cfg) -> str:
    if topo.tensor == 1:
        return ""
    if topo.pipeline > 1:
        return ", LM head replicated (vocab_parallel does not apply to pipeline stages)"
    note = ", LM head split by vocabulary" if parallel_cfg.vocab_parallel else ", LM head replicated"
    return note + (", sequence parallel" if parallel_cfg.sequence_parallel else "")


def check_pipeline(topo, zero_stage: int, ds_path):
    if topo.pipeline == 1:
        return
    if zero_stage >= 2:
        raise DrScaleError(f"{ds_path}: zero_optimization.stage={zero_stage} with "
                           f"parallel.pipeline_parallel={topo.pipeline}: DeepSpeed's pipeline engine "
                           f"supports ZeRO-0/1 only; use zero1 (or pipeline_parallel=1 with ZeRO-3)")


def check_precision(ds: dict, ds_path):
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    precision = dsc.precision(ds)
    supported = {"bf16": acc.is_bf16_supported, "fp16": acc.is_fp16_supported}
    if precision in supported and not supported[precision]():
        alternative = "a bf16 config such as zero2" if precision == "fp16" else "an fp16 config"
        raise DrScaleError(f"{ds_path}: {precision}.enabled: {precision} is not supported on the "
                           f"{acc.device_name()} accelerator here; use {alternative}")


def _dotted_path(ds: dict, loc) -> str:
    """DeepSpeed validates sections separately, so its error path lacks the section: find it."""
    def search(node, prefix):
        if not isinstance(node, dict):
            return None
        probe = node
        for part in loc:
            if not isinstance(probe, dict) or part not in probe:
                probe = None
                break
            probe = probe[part]
        if probe is not None:
            return prefix + ".".join(loc)
        for k, v in node.items():
            hit = search(v, f"{prefix}{k}.")
            if hit:
                return hit
        return None

    return search(ds, "") or ".".join(loc)


def _initialize_engine(deepspeed, model, groups, ds, scheduler, ds_path, mpu=None):
    """deepspeed.initialize, with DeepSpeed's own config complaints turned into one line."""
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds,
                                               lr_scheduler=scheduler, mpu=mpu)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        errors = getattr(e, "errors", None)
        if callable(errors) and errors():
            first = errors()[0]
            where = _dotted_path(ds, [str(x) for x in first.get("loc", ())])
            raise DrScaleError(f"{ds_path}: {where}: {first.get('msg')} (DeepSpeed)") from None
        raise DrScaleError(f"{ds_path}: DeepSpeed rejected the config: "
                           f"{str(e).splitlines()[0]}") from None
    return engine


def main(argv=None):
    try:
        args = parse_args(argv)
        run(args)
    except TrainingStopped as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"dr_scale: stopped: {e}", file=sys.stderr, flush=True)
        close_distributed()  # every rank stops at the same step, so they can leave together
        sys.exit(3)
    except DrScaleError as e:
        rank = os.environ.get("RANK", "0")
        prefix = "" if rank == "0" else f"[rank {rank}] "
        print(f"{prefix}dr_scale: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
