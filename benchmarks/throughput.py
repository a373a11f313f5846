#!/usr/bin/env python
"""Throughput of a preset under one or more DeepSpeed configs, each point its own launcher job.

    python benchmarks/throughput.py --preset tiny --ds_config zero0 zero3 --ranks 2 --steps 30

Prints, per point, the steady-state tokens/s (all ranks), TFLOP/s per rank, MFU and peak memory
per rank (median over log windows after the first, which holds warm-up), and writes
results.jsonl + results.md to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_point(preset, ds_config, ranks, steps, seq, micro, extra, workdir):
    run_dir = Path(workdir) / f"{preset}-{ds_config}-{ranks}r"
    port = ["--master_port", str(29500 + os.getpid() % 1000)]
    cmd = ["deepspeed", "--num_gpus", str(ranks), *port, str(ROOT / "launchers" / "pretrain.py"),
           "--ds_config", ds_config, "--run_dir", str(run_dir), f"model.preset={preset}",
           f"train.max_steps={steps}", f"train.micro_batch_size={micro}",
           f"data.seq_length={seq}", "train.log_interval=5", f"train.eval_interval={steps}",
           "train.eval_samples=8", f"train.save_interval={steps}", "train.warmup_steps=5",
           "logging.plot=false", "logging.tensorboard=false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"benchmark point {preset}/{ds_config} failed:\n{tail}")
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "tokens_per_s" in r][1:]  # drop the warm-up window
    if not train:
        raise SystemExit(f"{run_dir}: too few steps to measure; raise --steps")
    med = lambda k: statistics.median(r[k] for r in train)  # noqa: E731
    return {"preset": preset, "ds_config": ds_config, "ranks": ranks, "seq_length": seq,
            "micro_batch_size": micro, "tokens_per_s": med("tokens_per_s"),
            "tflops": med("tflops"), "mfu": med("mfu"),
            "mem_peak_bytes": max(r["mem_peak_bytes"] for r in train),
            "step_time_s": med("step_time_s")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ds_config", nargs="+", default=["zero0", "zero1", "zero2", "zero3"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--out", default="bench_out")
    p.add_argument("overrides", nargs="*", help="extra dotted.key=value for every point")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ds in a.ds_config:
            print(f"running {a.preset} / {ds} on {a.ranks} rank(s) ...", file=sys.stderr, flush=True)
            row = run_point(a.preset, ds, a.ranks, a.steps, a.seq_length, a.micro_batch_size,
                            a.overrides, work)
            rows.append(row)
            print(f"{row['preset']:<10} {row['ds_config']:<14} {row['tokens_per_s']:>10,.0f} tok/s "
                  f"{row['tflops']:>8.4f} TFLOP/s/rank  MFU {100 * row['mfu']:5.1f}%  "
                  f"peak {row['mem_peak_bytes'] / 2**20:,.0f} MiB/rank", flush=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = ["| preset | ds_config | ranks | tokens/s | TFLOP/s per rank | MFU | peak MiB per rank |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['ds_config']} | {r['ranks']} | {r['tokens_per_s']:,.0f} | "
              f"{r['tflops']:.4f} | {100 * r['mfu']:.1f}% | {r['mem_peak_bytes'] / 2**20:,.0f} |"
              for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.jsonl'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
