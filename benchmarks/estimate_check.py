#!/usr/bin/env python
"""The memory estimator against measured peaks, side by side, one launcher job per layout.

    python benchmarks/estimate_check.py --out bench_out/estimate

Each layout trains a few steps; the measured peak per rank (max over ranks: resident set size on
CPU, allocator peak on a GPU) is set beside `dr-scale estimate`'s total for the same settings.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ["model.preset=tiny", "model.hidden_size=512", "model.num_layers=6", "model.num_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=1408", "data.seq_length=256",
         "train.micro_batch_size=4"]
LAYOUTS = {  # name: (ds_config, ranks, overrides)
    "zero0_2r": ("zero0", 2, []),
    "zero1_2r": ("zero1", 2, []),
    "zero3_2r": ("zero3", 2, []),
    "zero1_tp2": ("zero1", 2, ["parallel.tensor_parallel=2"]),
    "zero2_1r_ckpt": ("zero2", 1, ["parallel.activation_checkpointing=full"]),
}


def measure(name, ds, ranks, extra, work, steps=3):
    run = Path(work) / name
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29700 + os.getpid() % 200),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", ds, "--run_dir", str(run),
           *SHAPE, f"train.max_steps={steps}", "train.log_interval=1", "train.eval_interval=1000",
           f"train.save_interval={steps + 1}", "train.eval_samples=4", "logging.plot=false",
           "logging.tensorboard=false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n" + "\n".join(proc.stderr.splitlines()[-20:]))
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return max(r["mem_peak_bytes"] for r in recs if "mem_peak_bytes" in r)


def estimated(ds, ranks, extra, device):
    out = subprocess.run([sys.executable, "-m", "dr_scale.cli", "estimate", "--ds_config", ds,
                          "--ranks", str(ranks), "--device", device, "--json", *SHAPE,
                          "model.vocab_size=4096", *extra],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["bytes_per_rank"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default="bench_out/estimate")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in a.layouts:
            ds, ranks, extra = LAYOUTS[name]
            est = estimated(ds, ranks, extra, "cpu")
            peak = measure(name, ds, ranks, extra, work)
            rows.append({"layout": name, "measured_bytes": peak, "estimate": est,
                         "ratio": est["total"] / peak})
            print(f"{name:<16} measured {peak / 2**20:8.0f} MiB  estimated "
                  f"{est['total'] / 2**20:8.0f} MiB  ratio {est['total'] / peak:.3f}", flush=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
