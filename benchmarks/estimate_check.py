#!/usr/bin/env python
"""The memory estimator against measured peaks, side by side, one launcher job per layout.

    python benchmarks/estimate_check.py --out bench_out/estimate

Each layout trains a few steps; the measured peak per rank (max over ranks: resident set size on
CPU, allocator peak on a GPU) is set beside `dr-scale estimate`'s total for the same settings.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import estimate_bytes, run_point  # noqa: E402

SEQ, MICRO = 256, 4
SHAPE = ["model.hidden_size=512", "model.num_layers=6", "model.num_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=1408"]  # on the tiny preset
LAYOUTS = {  # name: (ds_config, ranks, overrides)
    "zero0_2r": ("zero0", 2, []),
    "zero1_2r": ("zero1", 2, []),
    "zero3_2r": ("zero3", 2, []),
    "zero1_tp2": ("zero1", 2, ["parallel.tensor_parallel=2"]),
    "zero2_1r_ckpt": ("zero2", 1, ["parallel.activation_checkpointing=full"]),
}


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
            row = run_point("tiny", ds, ranks, 4, SEQ, MICRO, SHAPE + extra, work,
                            log_interval=1)
            peak = row["mem_peak_bytes"]
            est = estimate_bytes("tiny", ds, ranks, SEQ, MICRO, SHAPE + extra,
                                 row["vocab_size"], "cpu")
            rows.append({"layout": name, "measured_bytes": peak, "estimate_bytes": est,
                         "ratio": est / peak})
            print(f"{name:<16} measured {peak / 2**20:8.0f} MiB  estimated "
                  f"{est / 2**20:8.0f} MiB  ratio {est / peak:.3f}", flush=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
