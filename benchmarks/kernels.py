#!/usr/bin/env python
"""Kernel benchmark on a CUDA device: our kernels against torch, side by side in one run.

    python benchmarks/kernels.py --out bench_out/kernels

Attention: forward + backward TFLOP/s of triton_flash against torch SDPA's flash backend and
eager attention (bf16, head_dim 128, causal unless --full), over sequence lengths. Fused ops
(RMSNorm, LayerNorm, SwiGLU, bias+GeLU, rotary, cross-entropy): forward + backward time against
the torch reference. Writes results.jsonl and results.md.
"""
import argparse
import json
import sys
from pathlib import Path

import torch


def bench(fn, warmup=5, reps=20) -> float:
    """Median milliseconds of fn() on the GPU (triton's do_bench: flushes L2 between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=reps, return_mode="median")


def fwd_bwd(fn, inputs):
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    dy = torch.randn_like(out)

    def run():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(dy)
    return run


def attention_rows(seqs, head_dim, causal, dtype, batch_tokens=16384, heads=16):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dr_scale.kernels import flash_attention, reference

    rows = []
    for s in seqs:
        b = max(1, batch_tokens // s)
        q, k, v = (torch.randn(b, heads, s, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        # fwd 4*b*h*s*s*d (two matmuls), bwd 2.5x that; causal halves it
        flops = 4 * b * heads * s * s * head_dim * 3.5 * (0.5 if causal else 1.0)

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        impls = {"triton_flash": lambda q, k, v: flash_attention(q, k, v, causal=causal),
                 "sdpa_flash": sdpa}
        if b * heads * s * s * 4 < 8e9:  # eager materializes the scores: skip what cannot fit
            impls["eager"] = lambda q, k, v: reference.attention(q, k, v, causal=causal)
        row = {"kernel": "attention", "seq": s, "batch": b, "heads": heads, "head_dim": head_dim,
               "causal": causal, "dtype": str(dtype).replace("torch.", "")}
        for name, fn in impls.items():
            ms = bench(fwd_bwd(fn, [q, k, v]))
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / ms / 1e9
        row["triton_vs_sdpa_flash"] = row["triton_flash_tflops"] / row["sdpa_flash_tflops"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fused_rows(dtype, tokens=16384, hidden=4096, ffn=11008, vocab=32000):
    from dr_scale.kernels import cross_entropy, cuda, reference

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.ones(hidden, device="cuda", dtype=dtype)
    bias = torch.zeros(hidden, device="cuda", dtype=dtype)
    g = torch.randn(tokens, ffn, device="cuda", dtype=dtype)
    cos, sin = reference.rotary_tables(2048, 128, 10000.0, device="cuda")
    q = torch.randn(tokens // 2048, 32, 2048, 128, device="cuda", dtype=dtype)
    logits = torch.randn(tokens // 2, vocab, device="cuda", dtype=dtype)
    labels = torch.randint(0, vocab, (tokens // 2,), device="cuda")
    cases = {
        "rms_norm": (lambda x, w: cuda.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm(x, w, 1e-5), [x, w]),
        "layer_norm": (lambda x, w, b: cuda.layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), [x, w, bias]),
        "swiglu": (cuda.swiglu, reference.swiglu, [g, g]),
        "bias_gelu": (cuda.bias_gelu, reference.bias_gelu, [x, bias]),
        "rotary": (lambda q: cuda.apply_rotary(q, cos, sin), lambda q: reference.apply_rotary(q, cos, sin), [q]),
        "cross_entropy": (lambda l: cross_entropy(l, labels), lambda l: reference.cross_entropy(l, labels), [logits]),
    }
    rows = []
    for name, (fast, ref, inputs) in cases.items():
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""),
               "fused_ms": bench(fwd_bwd(fast, inputs)), "torch_ms": bench(fwd_bwd(ref, inputs))}
        row["speedup"] = row["torch_ms"] / row["fused_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--full", action="store_true", help="full (non-causal) attention")
    p.add_argument("--out", default="bench_out/kernels")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py: needs a CUDA device (CPU correctness: "
                 "pytest tests/test_kernels_triton.py)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    rows = attention_rows(a.seqs, a.head_dim, not a.full, torch.bfloat16) + fused_rows(torch.bfloat16)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = [f"device: {torch.cuda.get_device_name()}", "",
             "| seq | triton_flash TFLOP/s | SDPA flash TFLOP/s | eager TFLOP/s | triton / SDPA |",
             "|---|---|---|---|---|"]
    for r in rows:
        if r["kernel"] == "attention":
            eager = f"{r['eager_tflops']:.1f}" if "eager_tflops" in r else "-"
            lines.append(f"| {r['seq']} | {r['triton_flash_tflops']:.1f} | "
                         f"{r['sdpa_flash_tflops']:.1f} | {eager} | {r['triton_vs_sdpa_flash']:.2f} |")
    lines += ["", "| op (fwd+bwd) | fused ms | torch ms | speedup |", "|---|---|---|---|"]
    for r in rows:
        if r["kernel"] != "attention":
            lines.append(f"| {r['kernel']} | {r['fused_ms']:.3f} | {r['torch_ms']:.3f} | "
                         f"{r['speedup']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
