#!/usr/bin/env python
"""The experts of a mixture-of-experts block, two ways side by side: three grouped matmuls over
all experts (torch._grouped_mm, what models/moe.py runs) against one expert at a time (a Python
loop of matmuls), forward and backward, at a run's shapes.

    python benchmarks/moe_experts.py [--shapes moe_tiny moe_1b_7b] [--tokens 2048]
                                     [--dtypes fp32 bf16] [--repeats 5] [--out bench_out/moe_experts]

Per shape and dtype: the routed rows of `--tokens` tokens (x top-k, spread over the experts as a
trained router spreads them: unevenly, the busiest expert 2x the mean), both ways interleaved
repeat by repeat, the median time; the largest difference of their outputs and gradients. Writes
results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import os
import statistics
import time

import torch

from bench_results import write_results

SHAPES = {"moe_tiny": dict(hidden=256, ffn=352, experts=8, top_k=2),
          "moe_1b_7b": dict(hidden=2048, ffn=1024, experts=64, top_k=8)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def uneven_counts(rows: int, experts: int) -> torch.Tensor:
    """Rows per expert, the busiest twice the mean, the rest falling off linearly."""
    weights = torch.linspace(2.0, 0.2, experts)
    counts = (weights / weights.sum() * rows).floor().long()
    counts[-1] += rows - counts.sum()
    return counts


def one_way(impl, x, weights, counts, grad_out):
    for p in (x, *weights):
        p.grad = None
    start = time.perf_counter()
    out = impl(x, *weights, counts)
    out.backward(grad_out)
    return time.perf_counter() - start, out.detach(), [p.grad for p in (x, *weights)]


def measure(name, shape, dtype_name, tokens, repeats):
    from dr_scale.kernels.grouped import experts_grouped_mm, experts_loop

    dtype, g = DTYPES[dtype_name], torch.Generator().manual_seed(0)
    d, f, e, k = shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"]
    rows = tokens * k
    x = (torch.randn(rows, d, generator=g) * 0.5).to(dtype).requires_grad_()
    weights = [(torch.randn(*s, generator=g) * 0.02).to(dtype).requires_grad_()
               for s in ((e, f, d), (e, d, f), (e, f, d))]
    counts, grad_out = uneven_counts(rows, e), torch.randn(rows, d, generator=g).to(dtype)
    times = {"grouped_mm": [], "loop": []}
    results = {}
    for _ in range(repeats + 1):  # the first of each is a warm-up
        for impl_name, impl in (("grouped_mm", experts_grouped_mm), ("loop", experts_loop)):
            seconds, out, grads = one_way(impl, x, weights, counts, grad_out)
            times[impl_name].append(seconds)
            results[impl_name] = (out, grads)
    (a, ga), (b, gb) = results["grouped_mm"], results["loop"]
    diff = max([((a.float() - b.float()).abs().max() / b.float().abs().max()).item()]
               + [((p.float() - q.float()).abs().max() / q.float().abs().max()).item()
                  for p, q in zip(ga, gb)])
    grouped = statistics.median(times["grouped_mm"][1:])
    loop = statistics.median(times["loop"][1:])
    return {"shape": name, "dtype": dtype_name, "tokens": tokens, "experts": e, "top_k": k,
            "grouped_mm_ms": round(grouped * 1e3, 2), "loop_ms": round(loop * 1e3, 2),
            "grouped_over_loop": round(grouped / loop, 3), "largest_relative_difference": diff}


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_out/moe_experts")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s), {torch.get_num_threads()} thread(s)"
    print(f"MoE experts, grouped matmuls vs a loop per expert, forward + backward, {a.tokens} "
          f"tokens, on {where}", flush=True)
    rows = []
    for name in a.shapes:
        for dtype_name in a.dtypes:
            row = measure(name, SHAPES[name], dtype_name, a.tokens, a.repeats)
            rows.append(row)
            print(f"  {name} {dtype_name}: grouped {row['grouped_mm_ms']} ms, loop "
                  f"{row['loop_ms']} ms ({row['grouped_over_loop']}x), largest relative "
                  f"difference {row['largest_relative_difference']:.1e}", flush=True)
    write_results(a.out, rows, f"# MoE experts: grouped matmuls vs a loop per expert, forward + "
                  f"backward, {a.tokens} tokens ({where})",
                  [("shape", "shape"), ("dtype", "dtype"), ("experts", "experts"),
                   ("top-k", "top_k"), ("grouped (ms)", "grouped_mm_ms"), ("loop (ms)", "loop_ms"),
                   ("grouped / loop", "grouped_over_loop"),
                   ("largest relative difference", "largest_relative_difference")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
