#!/usr/bin/env python
"""A mixture of experts against the dense model of the same active parameters, side by side:
`moe_tiny` (8 experts of width 352, top-2) against `tiny` (one MLP of width 704, the same
attention), each a launcher job under the same DeepSpeed config and ranks, interleaved repeat by
repeat; tokens/s and MFU (MoE: by active parameters) as medians over the repeats. With
--expert_parallel N a third row: moe_tiny with its experts split over N ranks.

    python benchmarks/moe_throughput.py [--ds_config zero2] [--ranks 2] [--steps 30]
                                        [--repeats 2] [--expert_parallel 2]
                                        [--out bench_out/moe_throughput]

Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import os
import tempfile

from bench_results import write_results
from throughput import medians, percent, run_point

PAIR = ("tiny", "moe_tiny")  # dense first


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds_config", default="zero2")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--expert_parallel", type=int, default=1,
                    help="> 1: also moe_tiny with parallel.expert_parallel=N")
    ap.add_argument("--out", default="bench_out/moe_throughput")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"MoE vs dense of the same active parameters: {' vs '.join(PAIR)}, {a.ds_config}, "
          f"{a.ranks} rank(s), {a.micro_batch} x {a.seq_length} tokens a micro-batch, on "
          f"{where}", flush=True)
    # label -> (preset, extra overrides)
    layouts = {p: (p, []) for p in PAIR}
    if a.expert_parallel > 1:
        layouts[f"moe_tiny EP {a.expert_parallel}"] = (
            "moe_tiny", [f"parallel.expert_parallel={a.expert_parallel}"])
    points = {label: [] for label in layouts}
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as work:
        for repeat in range(a.repeats):
            for label, (preset, extra) in layouts.items():
                row = run_point(preset, a.ds_config, a.ranks, a.steps, a.seq_length,
                                a.micro_batch, extra, work)
                points[label].append(row)
                print(f"  repeat {repeat + 1} {label}: {row['tokens_per_s']:,.0f} tokens/s, "
                      f"MFU {percent(row['mfu'])}", flush=True)
    rows = []
    for label, runs in points.items():
        row = medians(runs)  # MFU over the row's one peak, as each run's is
        rows.append({"preset": label, "parameters": row["parameters"],
                     "tokens_per_s": row["tokens_per_s"], "mfu": row["mfu"],
                     "peak_tflops": row["peak_tflops"], "repeats": len(runs)})
    dense = rows[0]
    for row in rows:
        row["tokens_per_s_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
    for row in rows[1:]:
        print(f"{row['preset']} / {PAIR[0]}: tokens/s {row['tokens_per_s_vs_dense']}x, MFU "
              f"{percent(row['mfu'])} vs {percent(dense['mfu'])}")
    write_results(a.out, rows, f"# MoE vs dense of the same active parameters, {a.ds_config}, "
                  f"{a.ranks} rank(s), {a.micro_batch} x {a.seq_length} tokens ({where})",
                  [("preset", "preset"), ("parameters", "parameters"),
                   ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
                   ("MFU", lambda r: percent(r["mfu"])),
                   ("tokens/s vs dense", "tokens_per_s_vs_dense"), ("repeats", "repeats")],
                  dict(cpu=where, ds_config=a.ds_config, ranks=a.ranks))


if __name__ == "__main__":
    main()
