"""`deepspeed launchers/pretrain.py --ds_config zero3.json [--config Y] [--run_dir D] [--resume]
[dotted.key=value ...]` (or `deepspeed --module dr_scale.launch ...` from an installed copy).

The run is a plan, then steps: check (dr_scale/plan.py: everything a config can get wrong,
before any process group, writing nothing) -> prepare_files (what writes before the group: a
fresh start's leftovers cleared) -> start_group -> agree_on_checkpoint (a resume's checkpoint
checked by all ranks, converted where the layout changed) -> prepare_data -> build
-> parallelize -> engine -> trainer. Each step takes the plan and adds what needs ranks.
"""
import os
import sys

import torch

from dr_scale.runtime import comm, nvme_offload, warm_imports
from dr_scale.config.arguments import parse_args
from dr_scale.data.prepare import prepare_data
from dr_scale.runtime.process_group import close_distributed
from dr_scale.runtime.ranks import global_rank, say, say_error
from dr_scale.errors import (EXIT_CONFIG, EXIT_FAULT, EXIT_PREEMPTED, EXIT_STOPPED, DrScaleError,
                             Preempted, TrainingStopped)
from dr_scale.export.hf import load_into
from dr_scale.models.build import with_tokenizer_vocab
from dr_scale.models.kernel_choice import select_kernels
from dr_scale.parallel import compile_choice
from dr_scale.parallel.parallelize import parallelize
from dr_scale.parallel.sharded_build import LOADED_LATER, build_for_run
from dr_scale.plan import RunPlan, check, start_group
from dr_scale.runtime import hangs, host_memory, suspects
from dr_scale.train.engine import initialize_engine
from dr_scale.train.metrics import MetricsLogger
from dr_scale.train.expert_load_plot import plot_expert_load
from dr_scale.train.plot import plot_curves
from dr_scale.checkpoint.agree import agree_on_checkpoint
from dr_scale.checkpoint.resume import prepare_files
from dr_scale.train.schedule import build_scheduler
from dr_scale.train.start import run_facts, start_lines, write_run_snapshot
from dr_scale.train.trainer import Trainer


def run(plan: RunPlan):
    warm_imports.start()  # the engine's imports, beside the rendezvous, data and build
    prepare_files(plan)                                                               # files
    group = start_group(plan)                                                         # ranks
    plan = agree_on_checkpoint(plan, group)  # each rank checks its share, one collective
    deepspeed, batch = plan.deepspeed, plan.deepspeed.batch
    offload_note = nvme_offload.prepare_dirs(group.ds, deepspeed.source)
    if "offload_param" in deepspeed.nvme_sections:
        nvme_offload.swap_in_each_parameter_once()
    resume = plan.resume
    sources = prepare_data(plan.cfg, plan.data, batch,                                # data
                           (resume.step, resume.consumed_samples) if resume else (0, 0))
    shape = with_tokenizer_vocab(plan.shape, plan.cfg, sources.tokenizer.vocab_size,  # model
                                 group.topology)
    shape, kernels_line = select_kernels(shape, plan.cfg, group.device.type,
                                         deepspeed.precision, group.topology)
    compiled, compile_line = compile_choice.settle(
        shape, plan.cfg, group.topology, deepspeed.stage, group.device, deepspeed.dtype,
        batch["micro"], kernels_line)
    torch.manual_seed(plan.cfg.train.seed)
    # glibc's handling of freed host memory, set before the build's tensors are made and freed
    memory_note = host_memory.settle(plan.cfg.train.release_host_memory, group.device.type)
    initial = None if resume else plan.init_weights  # on resume the checkpoint's weights win
    # ZeRO-3: sharded; TP or PP: on meta; nothing drawn where a checkpoint or init_from fills it
    model = build_for_run(shape, group.ds, group.topology,
                          draw=not resume and initial is None)
    if initial is not None:
        load_into(model, initial, plan.cfg.model.init_from)  # on meta: checked only
    facts = run_facts(model, shape, plan.cfg, deepspeed.precision, group.device, batch,
                      group.topology)
    parallel = parallelize(model, shape, group.topology, plan.cfg, group.ds,  # parallel
                           LOADED_LATER if resume else initial, compiled)
    if group.topology.rank == 0:
        write_run_snapshot(plan, group, shape, facts, sources)
    comm.barrier()
    # a fresh start in a run folder that never saved: all its earlier records are set aside
    logger = MetricsLogger(group.run_dir, plan.cfg.logging, plan.cfg.train.max_steps,
                           enabled=group.topology.rank == 0, run_name=group.run_dir.name,
                           resume_step=-1 if plan.fresh_over_old else resume and resume.step)
    for line in start_lines(plan, group, shape, facts, kernels_line, sources, offload_note,
                            memory_note):
        logger.info(line)
    logger.info(compile_line)
    scheduler = None if deepspeed.has_scheduler else \
        (lambda opt: build_scheduler(opt, plan.cfg.train))
    warm_imports.finish()
    engine = initialize_engine(parallel.model, group.ds, plan.cfg.train, scheduler,  # engine
                               deepspeed.path, parallel.mpu, group.topology.tensor_group)
    parallel.after_engine(engine)
    trainer = Trainer(plan, group, engine, sources, logger, facts)                    # trainer
    if resume:
        trainer.resume()
    try:
        trainer.fit()
    finally:
        logger.close()
    if group.topology.rank == 0 and plan.cfg.logging.plot:
        logger.info(f"wrote {plot_curves(group.run_dir)}")
        if shape.moe is not None:
            logger.info(f"wrote {plot_expert_load(group.run_dir)}")
    close_distributed()
    return group.run_dir


def main(argv=None):
    args = None
    try:
        args = parse_args(argv)
        plan = check(args)
    except DrScaleError as e:  # what a configuration can get wrong, found before any group
        say_error(str(e))
        leave(EXIT_CONFIG)
    try:
        run(plan)
        code = 0
    except TrainingStopped as e:
        if global_rank() == 0:
            say(f"dr_scale: stopped: {e}")
        close_distributed()  # every rank stops at the same step, so they can leave together
        code = EXIT_PREEMPTED if isinstance(e, Preempted) else EXIT_STOPPED
    except RuntimeError as e:  # a collective that timed out or lost its peer: one line
        error = hangs.as_error(e, global_rank())
        if error is None:
            raise
        say(f"dr_scale: error: {error}")
        code = EXIT_FAULT
    except AssertionError as e:  # DeepSpeed's parameter swapper's buffers too few or small
        error = nvme_offload.swapper_error(e, plan.deepspeed.source)
        if not error:
            raise
        say_error(error)
        code = EXIT_CONFIG  # a configuration the plan cannot see: DeepSpeed's buffers' use
    except DrScaleError as e:  # met while running: a save, a load, the data, a stall
        say_error(str(e))
        code = EXIT_FAULT
    except OSError as e:  # the file system: EIO, a full disk, a vanished file
        line = f"{e.filename or 'I/O'}: {e.strerror or e} (errno {e.errno})"
        say_error(line)
        suspects.note(plan.run_dir, [suspects.node_name()], f"I/O error: {line}")
        code = EXIT_FAULT
    leave(code)


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
