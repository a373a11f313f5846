#!/usr/bin/env python
"""Attention within packed documents against full causal attention, side by side in one run.

    python benchmarks/document_mask.py [--seq 2048] [--docs 8 64] [--out bench_out/document_mask]

Per attention implementation that runs on this device (sdpa, eager; triton_flash on a GPU), per
dtype: forward + backward milliseconds of full causal attention and of attention kept within
documents (equal lengths summing to --seq), one sequence of 12 heads x 64 (llama_125m's). Prints
a table and writes results.jsonl and results.md; the CPU model and thread count head both.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def timed_ms(fn, device, warmup=2, reps=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    from dr_scale.hardware import cpu_model
    from dr_scale.kernels.registry import implementation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--out", default="bench_out/document_mask")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else \
        f"{cpu_model()}, {torch.get_num_threads()} thread(s)"
    impls = ["sdpa", "eager"] + (["triton_flash"] if device == "cuda" else [])
    dtypes = [torch.float32, torch.bfloat16]
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        q, k, v, dy = (torch.randn(1, a.heads, a.seq, a.head_dim, generator=g).to(device, dtype)
                       for _ in range(4))
        for name in impls:
            attend = implementation("attention", name)

            def step(doc_ids=None):
                qx, kx, vx = (t.detach().requires_grad_() for t in (q, k, v))
                extra = {} if doc_ids is None else {"doc_ids": doc_ids}
                attend(qx, kx, vx, causal=True, **extra).backward(dy)
            causal_ms = timed_ms(step, device)
            for n in a.docs:
                ids = torch.repeat_interleave(torch.arange(n, dtype=torch.int32),
                                              a.seq // n + 1)[:a.seq][None].to(device)
                ms = timed_ms(lambda: step(ids), device)
                rows.append({"impl": name, "dtype": str(dtype).split(".")[-1], "seq": a.seq,
                             "documents": n, "causal_ms": round(causal_ms, 2),
                             "documents_ms": round(ms, 2), "ratio": round(ms / causal_ms, 3)})
                print(f"{name:13s} {rows[-1]['dtype']:9s} {n:3d} documents: {ms:8.1f} ms, full "
                      f"causal {causal_ms:8.1f} ms ({ms / causal_ms:.2f}x)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, device=where)) + "\n")
    lines = [f"Attention within documents vs full causal, forward + backward, 1 x {a.heads} heads "
             f"x {a.head_dim}, on {where}", "",
             "| implementation | dtype | documents | within documents (ms) | full causal (ms) | "
             "ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['impl']} | {r['dtype']} | {r['documents']} | {r['documents_ms']} | "
              f"{r['causal_ms']} | {r['ratio']} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.md'}")


if __name__ == "__main__":
    sys.exit(main())
