"""The launcher's steps in detail: command line, run folder, resume plan, data, kernels, the
figures a run reports against (FLOPs, peak) and what the start writes and says."""
import argparse
import dataclasses
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dr_scale import comm, nvme_offload
from dr_scale import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.config.snapshot import write_snapshot
from dr_scale.data.loader import build_sources, resolve_files
from dr_scale.data.tokenizer import file_sha256, tokenizer_file_in
from dr_scale.distributed import threads_per_rank
from dr_scale.errors import DrScaleError
from dr_scale.export.hf import apply_init_from
from dr_scale.kernels import measured, ops
from dr_scale.kernels.registry import candidates, select, unavailable
from dr_scale.models.build import count_parameters, flops_per_token, recompute_flops_per_token
from dr_scale.train.checkpoint import complete_tags, find_tag, saved_position
from dr_scale.train.reshard import (convert_to_universal, reshard_plan, universal_ready,
                                    wait_for_universal)
from dr_scale.train.engine import describe_optimizer
from dr_scale.train.peak_flops import Peak, largest_gemm, peak_flops

USAGE = ("deepspeed launchers/pretrain.py --ds_config NAME_OR_PATH [--config YAML] "
         "[--run_dir DIR] [--resume [auto]] [--stop_at_step N] [--skip_memory_check] "
         "[dotted.key=value ...]")
# What marks a folder as a run folder (--resume auto starts fresh only in one of these or none)
RUN_FILES = ("config.yaml", "run.json", "metrics.jsonl", "checkpoints", "ds_config.json")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise DrScaleError(f"command line: {message} (usage: {USAGE})")


def parse_args(argv=None):
    p = _Parser(prog="pretrain.py", usage=USAGE)
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON; bare names resolve to ds_configs/")
    p.add_argument("--config", help="experiment YAML; default: the embedded default")
    p.add_argument("--run_dir", help="run folder; default: runs/<date>-<time>")
    p.add_argument("--resume", action="store_const", const="latest",
                   help="continue from the run folder's latest checkpoint; `--resume auto`: "
                        "continue if it has one, start fresh if not (one command for launch and "
                        "requeue)")
    p.add_argument("--resume_mode", dest="resume", help=argparse.SUPPRESS)  # `--resume auto`
    p.add_argument("--stop_at_step", type=int, default=None, metavar="N",
                   help="save and exit after step N (the schedule still runs to train.max_steps)")
    p.add_argument("--skip_memory_check", action="store_true",
                   help="start even when the memory estimate exceeds what a rank has")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value")
    # overrides may come before, between or after the options, as people type them
    return p.parse_intermixed_args(_resume_forms(sys.argv[1:] if argv is None else list(argv)))


def _resume_forms(argv):
    """`--resume auto` / `--resume=auto` as one option, so a bare `--resume` never swallows the
    override that follows it."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--resume" and i + 1 < len(argv) and argv[i + 1] in ("auto", "latest"):
            out.append(f"--resume_mode={argv[i + 1]}")
            i += 2
            continue
        if tok.startswith("--resume="):
            mode = tok.split("=", 1)[1]
            if mode not in ("auto", "latest"):
                raise DrScaleError(f"command line: --resume={mode}: expected auto or latest")
            tok = f"--resume_mode={mode}"
        out.append(tok)
        i += 1
    return out


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
    init_state = None
    if cfg.model.init_from:
        init_state = apply_init_from(cfg)
    return cfg, run_dir, init_state


def choose_run_dir(run_dir, cfg, resume: bool) -> Path:
    if run_dir is None:  # one timestamp for all ranks
        run_dir = Path(cfg.run_dir or comm.broadcast_object(time.strftime("runs/%Y%m%d-%H%M%S")))
    run_dir = run_dir.resolve()
    if not resume and (run_dir / "checkpoints").exists():
        raise DrScaleError(f"{run_dir}: already holds checkpoints; pass --resume to continue it, "
                           "or choose another --run_dir")
    return run_dir


def reshard_before_group(run_dir: Path, topo, raw_ds: dict, timeout_s: int):
    """--resume on another number of ranks or ZeRO family: the checkpoint is converted to
    DeepSpeed's universal format before the process group exists, by global rank 0 (the others
    wait for its output on the shared file system), so no collective waits on the conversion."""
    ckpt_dir = run_dir / "checkpoints"
    tag = find_tag(ckpt_dir)
    stage = dsc.zero_stage(raw_ds)
    plan = reshard_plan(ckpt_dir, tag, topo.world, stage, topo.tensor, topo.pipeline,
                        target_nvme=nvme_offload.optimizer_on_nvme(raw_ds),
                        sub_group_size=dsc.sub_group_size(raw_ds))
    if plan != "universal" or universal_ready(ckpt_dir, tag, stage, topo.world):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"dr_scale: resharding {ckpt_dir / tag} for {topo.world} rank(s) at ZeRO-{stage} "
              f"(DeepSpeed universal checkpoint; `dr-scale reshard` does this ahead of a job)",
              flush=True)
        t0 = time.time()
        convert_to_universal(ckpt_dir, tag, stage, topo.world)
        print(f"dr_scale: resharded in {time.time() - t0:.1f} s", flush=True)
    else:
        wait_for_universal(ckpt_dir, tag, stage, topo.world, stall_s=timeout_s)


def plan_resume(ckpt_dir: Path, topo, ds: dict):
    """(step, samples consumed, plan) for --resume; "universal" loads the form
    reshard_before_group made."""
    tag = find_tag(ckpt_dir)
    stage = dsc.zero_stage(ds)
    plan = reshard_plan(ckpt_dir, tag, topo.world, stage, topo.tensor, topo.pipeline,
                        target_nvme=nvme_offload.optimizer_on_nvme(ds),
                        sub_group_size=dsc.sub_group_size(ds))
    if plan == "universal" and not universal_ready(ckpt_dir, tag, stage, topo.world):
        raise DrScaleError(f"{ckpt_dir / tag}: its universal form for {topo.world} rank(s) at "
                           f"ZeRO-{stage} went missing during start-up")
    step, consumed = saved_position(ckpt_dir / tag)
    return step, consumed, plan


def prepare_data(cfg, layout, resumed_run_dir=None, resume_at=(0, 0)):
    """Tokenizer + train/held-out streams. Local rank 0 builds what is built once (the bundled
    corpus on first use, the sample index caches) while the node's other ranks wait, then they
    map what it wrote. A resumed run must keep its tokenizer; `resume_at` (step, samples
    consumed) sizes the stream for the steps left at this run's global batch."""
    t = cfg.train
    step, consumed = resume_at
    train_samples = consumed + max(0, t.max_steps - step) * layout["global"]

    def sources_here(builder: bool):
        files = resolve_files(cfg.data)
        return build_sources(cfg.data, t.seed, train_samples=train_samples,
                             eval_samples=t.eval_samples, tokenizer_path=files[0], specs=files[1],
                             build_index=builder)
    builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    sources = sources_here(True) if builder else None
    comm.barrier()
    if sources is None:
        sources = sources_here(False)
    used = tokenizer_file_in(resumed_run_dir) if resumed_run_dir else None
    if used is not None and file_sha256(used) != sources.tokenizer.sha256:
        given = cfg.data.tokenizer or "the tokenizer trained on the bundled corpus"
        raise DrScaleError(f"{used}: the run was trained with this tokenizer, but the resumed "
                           f"config gives {given}; token ids would change meaning")
    return sources


def select_kernels(shape, cfg, device_type: str, precision: str, topo):
    """Settle `model.attention` and every op's implementation (`model.kernels`) for this process;
    returns the shape with a concrete attention name and the line that says the choices. `auto`
    is, on GPUs, the fastest implementation that passes its precision check on the run's own
    shapes (kernels/measured.py: rank 0 measures, its table is printed, the choice cached); on
    CPU, the best by priority. Positions per token (data.reset_positions) rule out a rotary
    kernel that takes one table."""
    dtype = dsc.torch_dtype(precision)
    forced = dict(cfg.model.kernels)
    unknown = sorted(set(forced) - set(ops.OPS))
    if unknown:
        raise DrScaleError(f"model.kernels.{unknown[0]}: unknown op; known: {', '.join(ops.OPS)}")
    facts = {"per_token_positions": cfg.data.reset_positions}
    attention_facts = {"head_dim": shape.head_dim, "dropout": shape.dropout}
    if device_type == "cuda":
        auto = {op: candidates(op, device_type, dtype, **facts)
                for op in ops.OPS if forced.get(op, "auto") == "auto"}
        if shape.attention == "auto":
            auto["attention"] = candidates("attention", device_type, dtype, **attention_facts)
        problem = kernel_problem(shape, cfg, topo)
        chosen, table = measured.choose({op: ks for op, ks in auto.items() if ks}, problem,
                                        torch.device("cuda", torch.cuda.current_device()), dtype)
        if topo.rank == 0:
            print(measured.format_table(table, problem, "cuda", dtype), flush=True)
            for reason, names in unavailable(device_type).items():  # e.g. the CUDA build's error
                print(f"kernels: not used ({', '.join(names)}): {reason}", flush=True)
        if "attention" in chosen:
            shape = dataclasses.replace(shape, attention=chosen.pop("attention"))
        forced.update(chosen)
    try:
        line = ops.use_kernels(device_type, dtype, forced, **facts)
    except DrScaleError as e:
        raise DrScaleError(f"model.{e}") from None
    name = shape.attention
    try:
        kernel = select("attention", device_type, dtype, force=None if name == "auto" else name,
                        **attention_facts)
    except DrScaleError as e:
        raise DrScaleError(f"model.attention: {str(e).split(': ', 1)[-1]}") from None
    shape = dataclasses.replace(shape, attention=kernel.name)
    return shape, f"{line}, attention={kernel.name}"


def kernel_problem(shape, cfg, topo) -> measured.Problem:
    """One rank's shapes for the kernel measurement: its heads and MLP columns under tensor
    parallelism, its share of the sequence under sequence parallelism for the row-wise ops
    (attention sees the whole sequence), the loss over a chunk of the fused head or all tokens.
    With document masking, four documents a sequence (the measurement cannot know the corpus's
    lengths; what matters is that the masked paths are the ones timed)."""
    tp, seq, batch = topo.tensor, cfg.data.seq_length, cfg.train.micro_batch_size
    tokens = batch * seq
    chunk = shape.loss_chunk if topo.pipeline == 1 else 0  # settled for the head's slice
    slices = topo.head_slices(cfg.parallel.vocab_parallel)
    return measured.Problem(
        batch=batch, seq=seq, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size // tp,
        heads=shape.num_heads // tp, kv_heads=max(1, shape.num_kv_heads // tp),
        head_dim=shape.head_dim, vocab=-(-shape.vocab_size // slices),
        loss_rows=min(tokens, chunk) if chunk else tokens,
        documents=4 if cfg.data.document_mask else 1)


@dataclass
class RunFacts:
    """What throughput is measured against: model FLOPs per token (MFU), with recomputation
    (HFU), and this rank's peak."""
    parameters: int
    flops_per_token: float
    hardware_flops_per_token: float
    peak: Peak


def run_facts(model, shape, cfg, precision: str, device, layout, topo) -> RunFacts:
    """Counted from the shape; the peak measured now on CPU (before any data worker starts),
    at this rank's largest matmul of a micro-batch."""
    seq, p = cfg.data.seq_length, cfg.parallel
    fpt = flops_per_token(shape, seq)
    hw = fpt + recompute_flops_per_token(shape, seq, p.activation_checkpointing, p.checkpoint_every)
    gemm = largest_gemm(shape, layout["micro"] * seq, topo.tensor)
    return RunFacts(count_parameters(model), fpt, hw, peak_flops(precision, device, gemm))


def write_run_snapshot(run_dir: Path, resume: bool, cfg, ds, topo, local_world, device, shape,
                       facts: RunFacts, sources, layout):
    snap_dir = run_dir / "resumes" / time.strftime("%Y%m%d-%H%M%S") if resume else run_dir
    write_snapshot(snap_dir, cfg, ds, {
        "world": {"world_size": topo.world, "ranks_per_node": local_world,
                  "data_parallel": topo.data, "tensor_parallel": topo.tensor,
                  "pipeline_parallel": topo.pipeline, "device": device.type,
                  "backend": dist.get_backend()},
        "model": {"shape": dataclasses.asdict(shape), "parameters": facts.parameters,
                  "flops_per_token": facts.flops_per_token,
                  "hardware_flops_per_token": facts.hardware_flops_per_token},
        "data": {"tokenizer": str(sources.tokenizer.path),
                 "tokenizer_sha256": sources.tokenizer.sha256,
                 "datasets": [{"prefix": d.indexed.prefix, "weight": float(w)}
                              for d, w in zip(sources.train.datasets, sources.train.weights)]},
        "batch": layout, "peak_flops": {"value": facts.peak.value, "source": facts.peak.source}})
    if not resume:
        shutil.copyfile(sources.tokenizer.path, run_dir / sources.tokenizer.file_name)


@dataclass
class StartLine:
    """What rank 0 says before the first step: world, precision and why, model, batch, layout,
    kernels, optimizer, and a warning where bf16 would be emulated."""
    topo: object
    local_world: int
    device: torch.device
    ds: dict
    raw_ds: dict
    bf16: object
    ds_path: Path
    cfg: object
    shape: object
    facts: RunFacts
    layout: dict
    run_dir: Path
    kernels_line: str
    documents: object = None  # data.documents.DocumentBoundaries

    def lines(self):
        t, c, layout = self.topo, self.cfg, self.layout
        precision = dsc.precision(self.ds)
        why, warning = dsc.bf16_choice(self.raw_ds, self.bf16, str(self.ds_path))
        yield (f"dr_scale: {t.world} rank(s) ({self.local_world} on this node), "
               f"{self.device.type}, {dist.get_backend()}, ZeRO-{dsc.zero_stage(self.ds)}, "
               f"{precision}{f' ({why})' if why else ''}; model {c.model.preset} "
               f"({self.shape.arch}) {self.facts.parameters / 1e6:.2f}M parameters; batch "
               f"{layout['micro']} x {layout['accum']} accumulation x {t.data} data-parallel = "
               f"{layout['global']} x {c.data.seq_length} tokens; run folder {self.run_dir}")
        if warning:
            yield warning
        if self.documents is not None and self.documents.active:
            yield self.documents.describe()
        overlap = self.ds.get("zero_optimization", {}).get("overlap_comm", False)
        yield (f"layout: {t.describe()}{lm_head_note(t, c.parallel)}; {self.kernels_line}; "
               f"{describe_optimizer(self.ds, c.train)}; gradients reduced in "
               f"{dsc.reduction_dtype(self.ds)}, overlap_comm {str(overlap).lower()}")
        threads = "" if self.device.type != "cpu" else \
            f"; {torch.get_num_threads()} thread(s) per rank " \
            f"({threads_per_rank(self.local_world)[1]})"
        yield f"peak (MFU's denominator): {self.facts.peak.value / 1e12:.3f} TFLOP/s per rank, " \
              f"{self.facts.peak.source}{threads}"


def lm_head_note(topo, parallel_cfg) -> str:
    if topo.tensor == 1:
        return ""
    if topo.pipeline > 1:
        return ", LM head replicated (vocab_parallel does not apply to pipeline stages)"
    note = ", LM head split by vocabulary" if parallel_cfg.vocab_parallel else ", LM head replicated"
    return note + (", sequence parallel" if parallel_cfg.sequence_parallel else "")
