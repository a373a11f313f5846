#!/usr/bin/env python
"""Per-step cost of the compatibility callbacks, measured side by side in one invocation.

    python benchmarks/callbacks_cost.py --preset tiny --ds_config zero3 --ranks 2

Runs the same point with no callback and with each callback on, and prints the median step time
and its ratio to the plain run (results.jsonl / results.md in --out).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import run_point  # noqa: E402

VARIANTS = {
    "none": [],
    "ema": ["callbacks={ema: {enabled: true, decay: 0.999}}"],
    "memory_monitor": ["callbacks={memory_monitor: {enabled: true}}"],
    "nan_guard": ["callbacks={nan_guard: {enabled: true}}"],
    "nan_guard_no_outputs": ["callbacks={nan_guard: {enabled: true, trace_outputs: false}}"],
    "per_layer_clip": ["callbacks={per_layer_clip: {enabled: true}}"],
    "grad_norm_monitor": ["callbacks={grad_norm_monitor: {enabled: true}}"],
    "dataloader_profiler": ["callbacks={dataloader_profiler: {enabled: true}}"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ds_config", default="zero3")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="bench_out/callbacks")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in a.variants:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            row = run_point(a.preset, a.ds_config, a.ranks, a.steps, a.seq_length,
                            a.micro_batch_size, VARIANTS[name], str(Path(work) / name))
            row["callbacks"] = name
            rows.append(row)
    base = next((r["step_time_s"] for r in rows if r["callbacks"] == "none"), rows[0]["step_time_s"])
    lines = ["| callbacks | step time (ms) | vs none | tokens/s |", "|---|---|---|---|"]
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            r["step_time_ratio"] = r["step_time_s"] / base
            f.write(json.dumps(r) + "\n")
            lines.append(f"| {r['callbacks']} | {1000 * r['step_time_s']:.1f} | "
                         f"{r['step_time_ratio']:.3f} | {r['tokens_per_s']:,.0f} |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    print(f"{a.preset} / {a.ds_config} / {a.ranks} rank(s)\n{table}")


if __name__ == "__main__":
    main()
