#!/usr/bin/env python
"""Streamed export: `dr-scale export` of a llama_1b ZeRO-3 checkpoint, peak RSS of the export
process (start-up included) against the size of the model it writes, and transformers loading
the folder with our logits.

    python benchmarks/export_stream.py [--preset llama_1b] [--max_shard_size 5GB]

The checkpoint comes from a 1-step run on one rank under the bundled zero3 config (bf16 where the
CPU computes it natively); its fp32 master weights are what the export reads. The logits check
builds our model from the consolidated checkpoint and transformers' from the exported folder
(fp32 both, 64 tokens). Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def train_one_step(preset, work) -> Path:
    run = Path(work) / "run"
    cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero3", "--run_dir", str(run),
           f"model.preset={preset}", "data.seq_length=64", "train.micro_batch_size=1",
           "train.global_batch_size=1", "train.max_steps=1", "train.save_interval=1",
           "train.warmup_steps=1", "train.eval_at_start=false", "train.eval_interval=1000",
           "logging.plot=false", "logging.tensorboard=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit("the run that makes the checkpoint failed:\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return run


def export(run, out, max_shard_size) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir", str(run),
                           "--out", str(out), "--max_shard_size", max_shard_size],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"export failed:\n{proc.stderr[-2000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    size = float(re.search(r"([\d.]+) GiB\) from", line).group(1))
    peak = float(re.search(r"peak RSS ([\d.]+) GiB", line).group(1))
    files = sorted(p.name for p in Path(out).glob("*.safetensors"))
    return {"seconds": round(time.perf_counter() - t0, 1), "model_gib": size, "peak_rss_gib": peak,
            "files": len(files), "index": (Path(out) / "model.safetensors.index.json").is_file()}


def logits_difference(run, out) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.models import build_model
    from dr_scale.checkpoint.layout import find_tag

    shape = run_shape(run)
    ours = build_model(shape)
    ours.load_state_dict(consolidated_state_dict(run / "checkpoints", find_tag(run / "checkpoints"),
                                                 shape))
    ids = torch.randint(0, shape.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.eval()(ids)
        del ours
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        return (a - hf(ids).logits).abs().max().item()


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--max_shard_size", default="5GB")
    ap.add_argument("--out", default="bench_out/export_stream")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"streamed export: {a.preset} ZeRO-3 checkpoint, --max_shard_size {a.max_shard_size}, "
          f"on {where}", flush=True)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as work:
        run = train_one_step(a.preset, work)
        row = export(run, Path(work) / "hf", a.max_shard_size)
        row["max_logit_difference"] = logits_difference(run, Path(work) / "hf")
    row.update(preset=a.preset, max_shard_size=a.max_shard_size)
    print(f"  wrote {row['model_gib']:.2f} GiB of fp32 weights in {row['files']} file(s) in "
          f"{row['seconds']:.0f} s; peak RSS of the export {row['peak_rss_gib']:.2f} GiB; "
          f"transformers' logits vs ours: max difference {row['max_logit_difference']:.2e}")
    write_results(a.out, [row], f"# Streamed export, {a.preset} ZeRO-3 ({where})",
                  [("preset", "preset"), ("model (GiB, fp32)", "model_gib"),
                   ("files", "files"), ("peak RSS (GiB)", "peak_rss_gib"),
                   ("seconds", "seconds"), ("max logit difference", "max_logit_difference")],
                  dict(cpu=where))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
