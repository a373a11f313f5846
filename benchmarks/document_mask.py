#!/usr/bin/env python
"""Attention within packed documents against full causal attention, side by side in one run.

    python benchmarks/document_mask.py [--seq 2048] [--docs 8 64] [--out bench_out/document_mask]

Per attention implementation that runs on this device (sdpa, eager; triton_flash on a GPU), per
dtype: forward + backward milliseconds of full causal attention and of attention kept within
documents (equal lengths summing to --seq), one sequence of 12 heads x 64 (llama_125m's). Then
the same for a whole model (--model, default llama_125m; sdpa, the run's precision by hardware):
a forward + backward step of one sequence, packed documents kept apart (masks and positions
from end-of-document tokens, as the trainer computes them) against full causal. Prints a table
and writes results.jsonl and results.md; the CPU model and thread count head both.
"""
import argparse
import statistics
import sys
import time

import torch

from bench_results import write_results


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


def model_rows(preset, seq, doc_counts, device):
    from dr_scale.config import load_config
    from dr_scale.data.documents import DocumentBoundaries
    from dr_scale.runtime.hardware import bf16_support
    from dr_scale.models import build_model, resolve_shape

    dtype = torch.bfloat16 if bf16_support(device).native else torch.float32
    shape = resolve_shape(load_config(overrides=[f"model.preset={preset}"]).model)
    torch.manual_seed(0)
    model = build_model(shape).to(device, dtype)
    eod = 2
    tokens = torch.randint(3, shape.vocab_size, (1, seq + 1), device=device)

    def step(batch, boundaries=None):
        inputs = batch[:, :-1]
        extra = boundaries.model_inputs(inputs) if boundaries else {}
        model(inputs, batch[:, 1:], **extra).backward()
        model.zero_grad(set_to_none=True)
    causal_ms = timed_ms(lambda: step(tokens), device, warmup=1, reps=3)
    rows = []
    for n in doc_counts:
        packed = tokens.clone()
        packed[0, seq // n - 1:seq:seq // n] = eod  # n documents of equal length
        ms = timed_ms(lambda: step(packed, DocumentBoundaries(eod, True, True)), device,
                      warmup=1, reps=3)
        rows.append({"impl": f"{preset} step (sdpa)", "dtype": str(dtype).split(".")[-1],
                     "seq": seq, "documents": n, "causal_ms": round(causal_ms, 1),
                     "documents_ms": round(ms, 1), "ratio": round(ms / causal_ms, 3)})
        print(f"{preset} forward + backward, {n} documents: {ms:.0f} ms, full causal "
              f"{causal_ms:.0f} ms ({ms / causal_ms:.2f}x)", flush=True)
    return rows


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model
    from dr_scale.kernels.registry import implementation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--model", default="llama_125m", help="a preset; none: attention only")
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
    if a.model != "none":
        rows += model_rows(a.model, a.seq, a.docs, device)
    write_results(a.out, rows, f"Attention within documents vs full causal, forward + "
                  f"backward, 1 x {a.heads} heads x {a.head_dim}, on {where}",
                  [("implementation", "impl"), ("dtype", "dtype"), ("documents", "documents"),
                   ("within documents (ms)", "documents_ms"), ("full causal (ms)", "causal_ms"),
                   ("ratio", "ratio")], dict(device=where))


if __name__ == "__main__":
    sys.exit(main())
