"""`dr-scale`: the side jobs around pretraining.

    dr-scale tokenizer  --input a.txt b.jsonl --out tok --vocab_size 8192
    dr-scale tokenizer  --type bpe --input a.jsonl --out tok   (a tokenizer.json)
    dr-scale preprocess --input a.jsonl b.parquet --tokenizer tok.model --out data/corpus [--workers N]
    dr-scale export     --run_dir runs/X --out hf/X [--step N] [--ema] [--max_shard_size 5GB]
    dr-scale eval       --hf hf/X --run_dir runs/X [--max_rel_diff 0.01] [--json]
    dr-scale reshard    --run_dir runs/X --ranks 16 [--zero_stage 3] [--step N] [--workers K]
    dr-scale presets
    dr-scale estimate   --ds_config zero3 --ranks 8 [--config Y] [dotted.key=value ...] [--json]
    dr-scale bench      [--quick] [benchmarks/throughput.py options]
"""
import argparse
import math
import os
import sys
import time

from dr_scale.errors import DrScaleError


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise DrScaleError(f"command line: {message} (see dr-scale {self.prog.split()[-1]} --help)")


def cmd_tokenizer(a):
    from dr_scale.data.text_files import iter_documents
    from dr_scale.data.tokenizer import load_tokenizer, train_bpe_tokenizer, train_tokenizer

    train = train_bpe_tokenizer if a.type == "bpe" else train_tokenizer
    model = train(iter_documents(a.input, a.text_key), a.out, a.vocab_size)
    tok = load_tokenizer(model)
    print(f"wrote {model} ({tok.kind}, vocab {tok.vocab_size}, end-of-document "
          f"{tok.eod_token!r} id {tok.eod_id})")


def cmd_preprocess(a):
    from dr_scale.data.preprocess import preprocess
    from dr_scale.data.tokenizer import load_tokenizer

    t0 = time.time()
    meta = preprocess(a.input, load_tokenizer(a.tokenizer), a.out, a.text_key, a.workers,
                      piece_bytes=int(a.piece_mib * 2**20) if a.piece_mib else None)
    print(f"wrote {a.out}.bin/.idx: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
          f"in {time.time() - t0:.1f} s with {a.workers} worker(s)")


def cmd_export(a):
    import resource
    from pathlib import Path

    from dr_scale.data.tokenizer import load_tokenizer, tokenizer_file_in
    from dr_scale.export.consolidate import checkpoint_source, ema_source, run_shape
    from dr_scale.export.hf import write_folder
    from dr_scale.export.safetensors_folder import parse_size
    from dr_scale.checkpoint import manifest
    from dr_scale.checkpoint.layout import find_tag
    from tqdm import tqdm  # percent, rate and ETA on stderr

    run_dir = Path(a.run_dir)
    shape = run_shape(run_dir)
    max_bytes = parse_size(a.max_shard_size)
    ckpt_dir = run_dir / "checkpoints"
    tag = find_tag(ckpt_dir, a.step)
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise DrScaleError(f"{out}: exists and is not empty; choose a new --out")
    fault = manifest.verify(ckpt_dir / tag)  # sizes, then every checksum
    if fault:
        raise DrScaleError(f"{ckpt_dir / tag}: not intact ({fault}); export another with "
                           "--step N (`dr-scale verify` lists them)")
    tok_file = tokenizer_file_in(run_dir)
    if tok_file is None:
        raise DrScaleError(f"{run_dir}: no tokenizer.model or tokenizer.json (not a run folder?)")
    source = ema_source(ckpt_dir / tag, shape) if a.ema else \
        checkpoint_source(ckpt_dir, tag, shape)
    total = sum(math.prod(s) for _, s in source.entries) * 4
    with tqdm(total=total, unit="B", unit_scale=True, desc="export") as bar:
        write_folder(out, source, shape, load_tokenizer(tok_file), max_shard_bytes=max_bytes,
                     progress=bar.update)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"wrote {out} (Hugging Face {shape.arch}, {len(files)} weight file(s), "
          f"{total / 2**30:.2f} GiB) from {ckpt_dir / tag}; peak RSS {peak:.2f} GiB")


def cmd_eval(a):
    import json

    import torch
    from tqdm import tqdm  # percent, rate and ETA on stderr

    from dr_scale.export.score import score

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bar = tqdm(desc="eval", unit="sample", disable=a.json)

    def progress(done, total, tokens_per_s):
        bar.total = total
        bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s", refresh=False)
        bar.update(done - bar.n)

    result = score(a.hf, a.run_dir, a.batch_size, device, progress)
    bar.close()
    if a.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"{a.hf}: held-out loss {result.loss:.4f} (ppl {math.exp(min(result.loss, 50)):.2f}) "
              f"on {result.samples} samples, {result.tokens:,} tokens, "
              f"{result.tokens / result.seconds:,.0f} tok/s; the run's eval_loss at step "
              f"{result.run_step}: {result.run_loss:.4f} ({100 * result.relative_difference:.2f}% "
              f"apart)")
    if a.max_rel_diff is not None and result.relative_difference > a.max_rel_diff:
        raise DrScaleError(f"{a.hf}: held-out loss {result.loss:.4f} is "
                           f"{100 * result.relative_difference:.2f}% from the run's "
                           f"{result.run_loss:.4f}, over --max_rel_diff {a.max_rel_diff}")


def cmd_reshard(a):
    import json
    import resource
    from pathlib import Path

    from dr_scale.config import ds_config as dsc
    from dr_scale.checkpoint.layout import TargetLayout, find_tag, saved_parallel_layout
    from dr_scale.checkpoint.reshard import convert_to_universal, default_workers, reshard_plan

    if a.to:
        a.ranks, a.tensor_parallel, a.pipeline_parallel, a.expert_parallel = parse_layout(a.to)
    elif a.ranks is None:
        raise DrScaleError("reshard: give --ranks N (with --tensor_parallel, --pipeline_parallel) "
                           "or --to \"dp=2 tp=1 pp=2\"")
    run_dir = Path(a.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    tag = find_tag(ckpt_dir, a.step)
    stage = a.zero_stage
    if stage is None:  # the run's own DeepSpeed config
        snapshot = run_dir / "ds_config.json"
        try:
            stage = dsc.zero_stage(json.loads(snapshot.read_text()))
        except (OSError, ValueError) as e:
            raise DrScaleError(f"{snapshot}: unreadable ({type(e).__name__}); give --zero_stage")
    tensor, pipeline, expert = saved_parallel_layout(ckpt_dir / tag)
    tensor = a.tensor_parallel or tensor
    pipeline = a.pipeline_parallel or pipeline
    expert = a.expert_parallel or expert
    target = TargetLayout(a.ranks, stage, tensor, pipeline, expert)
    plan = reshard_plan(ckpt_dir, tag, target)
    if plan == "direct":
        print(f"{ckpt_dir / tag}: loads as it is on {a.ranks} rank(s) at ZeRO-{stage}, TP "
              f"{tensor} x PP {pipeline} (EP {expert}); nothing to convert")
        return
    workers = a.workers or default_workers(ckpt_dir / tag)
    print(f"resharding {ckpt_dir / tag} for {a.ranks} rank(s) at ZeRO-{stage}, TP {tensor} x PP "
          f"{pipeline} (EP {expert}), with {workers} worker(s)", flush=True)
    t0 = time.time()
    out = convert_to_universal(ckpt_dir, tag, target, workers)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    print(f"wrote {out} in {time.time() - t0:.1f} s (largest process {peak:.2f} GiB); "
          f"`--resume` on {a.ranks} rank(s) loads it")


def parse_layout(text: str) -> tuple:
    """"dp=2 tp=1 pp=2 ep=1" -> (ranks, tensor, pipeline, expert); ep splits the experts
    within dp, so it adds no ranks."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "ep": 1}
    for part in text.replace(",", " ").split():
        key, _, value = part.partition("=")
        if key not in sizes or not value.isdigit() or int(value) < 1:
            raise DrScaleError(f"--to {text!r}: expected sizes like \"dp=2 tp=1 pp=2 ep=1\" (dp, "
                               f"tp, pp, ep, each a whole number >= 1), got {part!r}")
        sizes[key] = int(value)
    if sizes["dp"] % sizes["ep"]:
        raise DrScaleError(f"--to {text!r}: ep={sizes['ep']} must divide dp={sizes['dp']}")
    return sizes["dp"] * sizes["tp"] * sizes["pp"], sizes["tp"], sizes["pp"], sizes["ep"]


def cmd_verify(a):
    from pathlib import Path

    from tqdm import tqdm  # percent, rate and ETA on stderr

    from dr_scale.checkpoint import manifest
    from dr_scale.checkpoint.layout import complete_tags

    ckpt_dir = Path(a.run_dir) / "checkpoints"
    tags = complete_tags(ckpt_dir)
    if not tags:
        raise DrScaleError(f"{ckpt_dir}: no checkpoints")
    bad = 0
    for tag in tqdm(tags, desc="verify", unit="checkpoint", leave=False):
        t0 = time.time()
        fault = manifest.verify(ckpt_dir / tag, a.workers)
        body = manifest.read(ckpt_dir / tag) if fault is None else None
        size = sum(e["bytes"] for e in body["files"].values()) if body else 0
        state = ("intact" if body else "no manifest (written before manifests)") \
            if fault is None else f"NOT INTACT: {fault}"
        bad += fault is not None
        tqdm.write(f"{ckpt_dir / tag}: {state}" + (f" ({size / 2**30:.2f} GiB checked in "
                                                    f"{time.time() - t0:.1f} s)" if body else ""))
    if bad:
        raise DrScaleError(f"{ckpt_dir}: {bad} of {len(tags)} checkpoint(s) not intact; "
                           "--resume takes the newest intact one")


def cmd_presets(a):
    from dr_scale.config import load_config
    from dr_scale.models import all_presets, build_model, resolve_shape
    from dr_scale.models.build import count_parameters, spec_of

    print(f"{'preset':<13} {'arch':<8} {'params':>10} {'active':>10} {'GFLOP/token @2048':>18}")
    for name in all_presets():
        shape = resolve_shape(load_config(overrides=[f"model.preset={name}"]).model)
        spec = spec_of(shape.arch)
        n = count_parameters(build_model(shape, device="meta"))
        print(f"{name:<13} {shape.arch:<8} {n / 1e6:>9.1f}M "
              f"{spec.active_parameters(shape, n) / 1e6:>9.1f}M "
              f"{spec.flops_per_token(shape, 2048) / 1e9:>18.2f}")


def cmd_estimate(a):
    import json

    from dr_scale.config import ds_config as dsc
    from dr_scale.config import load_config
    from dr_scale.runtime.hardware import cpu_bf16_support
    from dr_scale.export.checkpoint_source import export_peak_bytes
    from dr_scale.parallel.estimate import estimate, inputs_for_run, shape_for_run
    from dr_scale.parallel.topology import Topology
    from dr_scale.units import format_bytes

    cfg = load_config(a.config, a.overrides)
    path = dsc.resolve_path(a.ds_config)
    topo = Topology.from_config(a.ranks, cfg.parallel)  # --ranks: the world it lays out
    tp, pp = topo.tensor, topo.pipeline
    # "auto" precision: a GPU run is planned for sm_80+ (bf16); a CPU run for this machine's CPU
    bf16_native = a.device != "cpu" or cpu_bf16_support().native
    ds = dsc.fill(dsc.read_json(path), cfg, topo.data, source=str(path),
                  bf16_native=bf16_native, device_type=a.device)
    shape = shape_for_run(cfg)
    est = estimate(shape, inputs_for_run(cfg, ds, topo, a.device))
    sizes = dict(est.as_dict(), export_peak=export_peak_bytes(shape, dsc.zero_stage(ds), topo))
    if a.json:
        print(json.dumps({"preset": cfg.model.preset, "ds_config": str(path), "ranks": a.ranks,
                          "tensor_parallel": tp, "pipeline_parallel": pp,
                          "expert_parallel": topo.expert,
                          "micro_batch_size": cfg.train.micro_batch_size,
                          "seq_length": cfg.data.seq_length,
                          "activation_checkpointing": cfg.parallel.activation_checkpointing,
                          "bytes_per_rank": sizes,
                          "largest_transient_is": est.transient_is}, indent=2))
        return
    ep = f" (EP {topo.expert})" if topo.experts_split else ""
    print(f"{cfg.model.preset} on {a.ranks} {a.device} rank(s), {path.name}, TP {tp} x PP "
          f"{pp}{ep}, micro-batch {cfg.train.micro_batch_size} x {cfg.data.seq_length} tokens, "
          f"checkpointing {cfg.parallel.activation_checkpointing}; per rank:")
    for key, value in sizes.items():
        if key == "host_offload" and not value:
            continue
        note = f"  ({est.transient_is})" if key == "largest_transient" else ""
        print(f"  {key:<17} {format_bytes(value):>12}{note}")


def cmd_bench(argv):
    """benchmarks/throughput.py of this checkout (benchmarks are not part of the wheel)."""
    from pathlib import Path
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"
    if not script.exists():
        raise DrScaleError(f"bench: {script} not found; dr-scale bench runs from a clone of the "
                           f"repository (pip install -e .)")
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


def build_parser():
    p = _Parser(prog="dr-scale", description="dr_scale side jobs")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("tokenizer", help="train a tokenizer on raw text")
    t.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl files (.gz too)")
    t.add_argument("--type", choices=["sentencepiece", "bpe"], default="sentencepiece",
                   help="sentencepiece: BPE with byte fallback (PREFIX.model); bpe: Hugging Face "
                   "byte-level BPE, as GPT-2 / Llama-3 (PREFIX.json, a tokenizer.json)")
    t.add_argument("--out", required=True, help="output prefix (writes PREFIX.model or .json)")
    t.add_argument("--vocab_size", type=int, default=32000)
    t.add_argument("--text_key", "--json_key", default="text",
                   help="the JSON key or Parquet column holding the text")
    t.set_defaults(fn=cmd_tokenizer)
    pp = sub.add_parser("preprocess", help="tokenize text into a .bin/.idx dataset")
    pp.add_argument("--input", nargs="+", required=True, help=".jsonl (one document a line), "
                    ".parquet (one a row) or .txt (one a file) files; .gz and .zst too")
    pp.add_argument("--tokenizer", required=True, help="sentencepiece .model, Hugging Face "
                    "tokenizer.json, or a folder holding one")
    pp.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin/.idx)")
    pp.add_argument("--text_key", "--json_key", default="text",
                    help="the JSON key or Parquet column holding the text")
    pp.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1),
                    help="tokenizing processes (default: one per core); the output is the same "
                    "for any number")
    pp.add_argument("--piece_mib", type=float, default=None,
                    help="JSON-lines files are cut into pieces of this size, the unit of work, "
                    "progress and resume (default: 1/64 of the input within 1-16 MiB; it "
                    "changes no output byte)")
    pp.set_defaults(fn=cmd_preprocess)
    ex = sub.add_parser("export", help="write a run's checkpoint as a transformers folder "
                        "(LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel)")
    ex.add_argument("--run_dir", required=True)
    ex.add_argument("--out", required=True)
    ex.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
    ex.add_argument("--ema", action="store_true", help="export the EMA weights")
    ex.add_argument("--max_shard_size", default="5GB",
                    help="largest weight file (5GB, 500MB, 2GiB); larger models are split into "
                         "model-0000k-of-0000n.safetensors with an index, as transformers does")
    ex.set_defaults(fn=cmd_export)
    ev = sub.add_parser("eval", help="score a transformers folder on a run's held-out samples, "
                        "beside the run's own eval_loss")
    ev.add_argument("--hf", required=True, help="a transformers folder (dr-scale export's)")
    ev.add_argument("--run_dir", required=True, help="the run whose held-out samples to use")
    ev.add_argument("--batch_size", type=int, default=4)
    ev.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ev.add_argument("--max_rel_diff", type=float, default=None,
                    help="exit 2 when the two losses differ by more (e.g. 0.01: 1%%)")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(fn=cmd_eval)
    rs = sub.add_parser("reshard", help="convert a checkpoint for another number of ranks or "
                        "ZeRO stage, ahead of the job that resumes it")
    rs.add_argument("--run_dir", required=True)
    rs.add_argument("--ranks", type=int, default=None, help="the world size of the resumed run")
    rs.add_argument("--to", default=None, help="the resumed run's layout, \"dp=2 tp=1 pp=2 "
                    "ep=1\" (instead of --ranks, --tensor_parallel, --pipeline_parallel, "
                    "--expert_parallel)")
    rs.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=None,
                    help="of the resumed run (default: the run's own ds_config.json)")
    rs.add_argument("--tensor_parallel", type=int, default=None,
                    help="of the resumed run (default: the checkpoint's own; ZeRO-1/2)")
    rs.add_argument("--pipeline_parallel", type=int, default=None,
                    help="of the resumed run (default: the checkpoint's own; ZeRO-1/2)")
    rs.add_argument("--expert_parallel", type=int, default=None,
                    help="of the resumed run (default: the checkpoint's own; ZeRO-1/2)")
    rs.add_argument("--step", type=int, default=None,
                    help="default: the latest checkpoint, the one --resume loads")
    rs.add_argument("--workers", type=int, default=None, help="parallel conversion processes "
                    "(default: cores, bounded by the memory one rank's file needs)")
    rs.set_defaults(fn=cmd_reshard)
    vf = sub.add_parser("verify", help="check a run's checkpoints against their manifests "
                        "(sizes and checksums)")
    vf.add_argument("--run_dir", required=True)
    vf.add_argument("--workers", type=int, default=None,
                    help="files read in parallel (default: cores, at most 8)")
    vf.set_defaults(fn=cmd_verify)
    pr = sub.add_parser("presets", help="list model presets with sizes")
    pr.set_defaults(fn=cmd_presets)
    es = sub.add_parser("estimate", help="predict per-rank memory of a run (no model allocated)")
    es.add_argument("--ds_config", required=True, help="a name in ds_configs/ or a path")
    es.add_argument("--config", default=None, help="experiment YAML")
    es.add_argument("--ranks", type=int, default=1, help="world size")
    es.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    es.add_argument("--json", action="store_true")
    es.add_argument("overrides", nargs="*", help="dotted.key=value")
    es.set_defaults(fn=cmd_estimate)
    sub.add_parser("bench", help="throughput sweep (benchmarks/throughput.py; --help there)")
    return p


def parse(parser, argv):
    """Like parse_args, with a command's dotted.key=value overrides allowed between its options
    (argparse's intermixed parsing does not take subcommands)."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-")
                                                    for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        raise DrScaleError(f"command line: unrecognized arguments: {' '.join(extra)} (see "
                           f"dr-scale {argv[0]} --help)")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:  # its options belong to the benchmark script
            return cmd_bench(argv[1:])
        args = parse(build_parser(), argv)
        args.fn(args)
    except DrScaleError as e:
        print(f"dr-scale: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
