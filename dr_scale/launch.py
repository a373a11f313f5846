"""`deepspeed launchers/pretrain.py --ds_config zero3.json [--config Y] [--run_dir D] [--resume]
[dotted.key=value ...]` (or `deepspeed --module dr_scale.launch ...` from an installed copy).

The run, as named steps: config -> topology -> data -> model -> parallelize -> engine -> trainer.
Everything a config can get wrong is checked before the process group starts.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from dr_scale import comm, nvme_offload, op_builds
from dr_scale import ds_config as dsc
from dr_scale.callbacks.build import build_callbacks
from dr_scale.data.documents import DocumentBoundaries
from dr_scale.data.loader import dataset_types
from dr_scale.distributed import close_distributed, init_distributed, world_size_from_env
from dr_scale.errors import (EXIT_PREEMPTED, EXIT_STOPPED, DrScaleError, Preempted,
                             TrainingStopped)
from dr_scale.export.hf import load_into
from dr_scale.hardware import bf16_support
from dr_scale.models import resolve_shape
from dr_scale.parallel import memory_guard
from dr_scale.parallel import parallelize as par
from dr_scale.parallel.sharded_build import build_for_run
from dr_scale.parallel.topology import Topology
from dr_scale.run_setup import (StartLine, choose_run_dir, load_run_config, parse_args,
                                plan_resume, prepare_data, reshard_before_group, run_facts,
                                select_kernels,
                                settle_resume, write_run_snapshot)
from dr_scale.train.engine import check_precision, initialize_engine
from dr_scale.train.metrics import MetricsLogger
from dr_scale.train.plot import plot_curves
from dr_scale.train.schedule import build_scheduler
from dr_scale.train import hangs, host_memory
from dr_scale.train.trainer import Trainer


def check_config(args):
    """Step 1, before any process group or build: the experiment config, the DeepSpeed JSON and
    every refusal of the parallel layout, against the world the launcher announced."""
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one machine's folder: one rank says it
        for line in op_builds.lock_warnings():
            say(f"dr_scale: warning: {line}")
    fresh_over_old = settle_resume(args)
    cfg, run_dir, init_state = load_run_config(args)
    ds_path = dsc.resolve_path(args.ds_config)
    raw_ds = dsc.read_json(ds_path)
    topo = Topology.from_config(world_size_from_env(), cfg.parallel)
    early_shape = resolve_shape(cfg.model)  # unknown preset, indivisible heads, attention name
    par.check(early_shape, topo, cfg, raw_ds, ds_path)
    nvme_offload.check_system(dsc.fill(raw_ds, cfg, topo.data, source=str(ds_path)), str(ds_path))
    build_callbacks(cfg.callbacks, topo.pipeline)
    dataset_types(cfg.data)
    if not args.skip_memory_check:  # before any rank allocates the model
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        ds = dsc.fill(raw_ds, cfg, topo.data, source=str(ds_path),
                      bf16_native=bf16_support(device_type).native, device_type=device_type)
        memory_guard.check(cfg, ds, topo.world, device_type, str(ds_path))
    if args.resume:
        reshard_before_group(run_dir.resolve(), topo, raw_ds, cfg.train.collective_timeout_s)
    return cfg, run_dir, init_state, ds_path, raw_ds, fresh_over_old


def run(args):
    cfg, run_dir, init_state, ds_path, raw_ds, fresh_over_old = check_config(args)  # config
    hangs.configure(cfg.train.collective_timeout_s)
    device, local_world = init_distributed(cfg.train.collective_timeout_s)
    topo = Topology.from_config(dist.get_world_size(), cfg.parallel, dist.get_rank())  # topology
    run_dir = choose_run_dir(run_dir, cfg, args.resume)
    bf16 = bf16_support(device.type)
    ds = dsc.fill(raw_ds, cfg, topo.data, source=str(ds_path), bf16_native=bf16.native,
                  device_type=device.type, run_dir=run_dir)
    precision = dsc.precision(ds)
    check_precision(ds, precision, ds_path)
    offload_note = nvme_offload.prepare_dirs(ds, str(ds_path))
    if "offload_param" in nvme_offload.nvme_sections(ds):
        nvme_offload.swap_in_each_parameter_once()
    layout = dsc.batch_layout(cfg.train, topo.data)
    resume_step, resume_at, resume_plan = None, (0, 0), None
    if args.resume:
        resume_step, consumed, resume_plan = plan_resume(run_dir / "checkpoints", topo, ds)
        resume_at = (resume_step, consumed)
        if resume_plan == "universal":
            ds = dict(ds, checkpoint=dict(ds.get("checkpoint", {}), load_universal=True))
    callbacks = build_callbacks(cfg.callbacks, topo.pipeline)

    sources = prepare_data(cfg, layout, run_dir if args.resume else None, resume_at)  # data
    shape = resolve_shape(cfg.model, sources.tokenizer.vocab_size)                  # model
    shape = shape.settle_loss_chunk(cfg.train.micro_batch_size * cfg.data.seq_length,
                                    topo.head_slices(cfg.parallel.vocab_parallel))
    if cfg.data.seq_length > shape.max_seq_length:
        raise DrScaleError(f"data.seq_length={cfg.data.seq_length} exceeds "
                           f"model.max_seq_length={shape.max_seq_length}")
    cfg.freeze()
    shape, kernels_line = select_kernels(shape, cfg, device.type, precision, topo)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.release_host_memory:  # before the build's whole tensors are made and freed
        host_memory.give_large_blocks_pages_of_their_own()
    model = build_for_run(shape, ds, topo)  # ZeRO-3: sharded as built; TP or PP: on meta
    initial = None if args.resume else init_state  # on resume the checkpoint's weights win
    if initial is not None:
        load_into(model, initial, cfg.model.init_from)  # on meta: checked only
    facts = run_facts(model, shape, cfg, precision, device, layout, topo)
    parallel = par.parallelize(model, shape, topo, cfg, ds, ds_path, initial)      # parallelize
    del init_state, initial

    if topo.rank == 0:
        write_run_snapshot(run_dir, args.resume, cfg, parallel.ds, topo, local_world, device,
                           shape, facts, sources, layout)
    comm.barrier()
    # a fresh start in a run folder that never saved: all its earlier records are set aside
    logger = MetricsLogger(run_dir, cfg.logging, cfg.train.max_steps, enabled=topo.rank == 0,
                           run_name=run_dir.name,
                           resume_step=-1 if fresh_over_old else resume_step)
    start = StartLine(topo, local_world, device, ds, raw_ds, bf16, ds_path, cfg, shape, facts,
                      layout, run_dir, kernels_line,
                      DocumentBoundaries.of(cfg.data, sources.tokenizer))
    memory_note = None
    if cfg.train.release_host_memory:
        memory_note = ("freed host memory returned to the OS after each backward, tensors "
                       f"from {host_memory.MMAP_THRESHOLD_BYTES // 2**20} MiB up in pages of "
                       "their own" if
                       host_memory.can_release() else "train.release_host_memory does nothing "
                       "here: the C library is not glibc (no malloc_trim)")
    for line in [*start.lines(), *([f"offload: {offload_note}"] if offload_note else []),
                 *([f"memory: {memory_note}"] if memory_note else []),
                 *(f"warning: {w}" for w in sources.warnings)]:
        logger.info(line)

    scheduler = None if "scheduler" in ds else (lambda opt: build_scheduler(opt, cfg.train))
    engine = initialize_engine(parallel.model, parallel.ds, cfg.train, scheduler, ds_path,  # engine
                               parallel.mpu)
    parallel.after_engine(engine)
    trainer = Trainer(engine, cfg, sources, layout, topo, run_dir, logger, facts,    # trainer
                      device, callbacks, stop_at_step=args.stop_at_step,
                      resume_plan=resume_plan)
    if args.resume:
        trainer.resume()
    try:
        trainer.fit()
    finally:
        logger.close()
    if topo.rank == 0 and cfg.logging.plot:
        logger.info(f"wrote {plot_curves(run_dir)}")
    close_distributed()
    return run_dir


def main(argv=None):
    args = None
    try:
        args = parse_args(argv)
        run(args)
        code = 0
    except TrainingStopped as e:
        if os.environ.get("RANK", "0") == "0":
            say(f"dr_scale: stopped: {e}")
        close_distributed()  # every rank stops at the same step, so they can leave together
        code = EXIT_PREEMPTED if isinstance(e, Preempted) else EXIT_STOPPED
    except RuntimeError as e:  # a collective that timed out or lost its peer: one line
        error = hangs.as_error(e, int(os.environ.get("RANK", "0")))
        if error is None:
            raise
        say(f"dr_scale: error: {error}")
        code = 1
    except AssertionError as e:  # DeepSpeed's parameter swapper's buffers too few or small
        error = args and nvme_offload.swapper_error(e, str(dsc.resolve_path(
            args.ds_config)))
        if not error:
            raise
        say_error(error)
        code = 2
    except DrScaleError as e:
        say_error(str(e))
        code = 2
    leave(code)


def say_error(text: str):
    """`dr_scale: error: text`, prefixed by the rank on every rank but 0."""
    rank = os.environ.get("RANK", "0")
    say(f"{'' if rank == '0' else f'[rank {rank}] '}dr_scale: error: {text}")


def say(line: str):
    """One line to stderr in one write. print() writes the text and its newline separately, and
    with stderr unbuffered (PYTHONUNBUFFERED, as launchers and schedulers often set it) two ranks
    stopping at once printed "line0line1\\n\\n": one merged line, seen in CI. A pipe takes a
    write of up to 4 KiB whole, so each rank's line stays its own."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def leave(code: int):
    """Exit with `code`, skipping the interpreter's finalisation. Gloo's worker threads can
    still be joinable when C++ statics are destroyed, even after destroy_process_group, and the
    process then aborts ("terminate called without an active exception", status 250) after a
    clean stop: seen in two CI runs of this suite (pytorch/pytorch#179291 tried an atexit fix
    and was abandoned). Everything of ours is closed by now; only the streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # deepspeed --module dr_scale.launch / python -m dr_scale.launch
    main()
