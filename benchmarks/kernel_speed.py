#!/usr/bin/env python
"""Kernel benchmark on a CUDA device: every registered implementation side by side in one run.

    python benchmarks/kernel_speed.py --out bench_out/kernels

Attention (bf16, head_dim 128, causal unless --full, GQA 32 query : 8 key/value heads as Llama's
larger presets): forward and forward + backward TFLOP/s and % of the part's datasheet peak, for
triton_flash, SDPA's flash and cuDNN backends and eager attention, over sequence lengths. Fused ops
(RMSNorm, LayerNorm, SwiGLU, bias+GeLU, rotary, cross-entropy): forward + backward time against the
torch reference, and the fused kernel's share of the part's memory bandwidth. The fused LM head
+ cross-entropy (llama_125m's width, 128,256 vocabulary) with its chunks' softmax and gradient in
Triton against torch. Writes
results.jsonl and results.md; an implementation that fails on this device is a row saying so.

Correctness decides the exit status: every implementation's forward output is set against the
fp32 reference on the same inputs (attention: torch's math attention in fp32; fused ops: the
torch reference in fp32) within the op's precision policy (kernels/policy.py); an error beyond
it, or a crash of ours (triton_flash, the fused CUDA ops, the fused head), exits 1. SDPA's
backends this device or shape lacks are rows saying so, not failures. The speed targets (Triton
flash forward+backward >= 0.9x SDPA's flash; fused ops >= 80% of the memory bandwidth) are
reported per row as met or missed.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ATTENTION = ("triton_flash", "sdpa_flash", "sdpa_cudnn", "eager")
OURS = ("triton_flash",)        # a crash of these fails the check; SDPA's backends may be absent
FLASH_TARGET, HBM_TARGET = 0.9, 80.0  # x SDPA flash's fwd+bwd TFLOP/s; % of memory bandwidth


def relative_error(got, want) -> float:
    """max |got - want| / max |want|, in fp32."""
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def within(err: float, pol, dtype) -> bool:
    """The policy's tolerance, taken relative to the output's scale (tests/test_kernels_*)."""
    tol = pol.tol(dtype)
    return err <= tol.atol + tol.rtol


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


def attention_rows(seqs, head_dim, causal, dtype, peak, batch_tokens=16384, heads=32,
                   kv_heads=8):
    from dr_scale.kernels import policy, reference
    from dr_scale.kernels.registry import implementation

    rows = []
    for s in seqs:
        b = max(1, batch_tokens // s)
        q = torch.randn(b, heads, s, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, kv_heads, s, head_dim, device="cuda", dtype=dtype)
                for _ in range(2))
        # forward 4*b*h*s*s*d (two matmuls), backward 2.5x that; causal halves both
        fwd_flops = 4 * b * heads * s * s * head_dim * (0.5 if causal else 1.0)
        row = {"kernel": "attention", "seq": s, "batch": b, "heads": f"{heads}:{kv_heads}",
               "head_dim": head_dim, "causal": causal, "dtype": str(dtype).replace("torch.", "")}
        one = (slice(0, 1),)  # the error on one sequence of the batch: the reference is eager
        with torch.no_grad():
            want = reference.attention(*(x[one].float() for x in (q, k, v)), causal=causal)
        for name in ATTENTION:
            if name == "eager" and b * heads * s * s * 4 >= 8e9:  # its fp32 scores cannot fit
                continue
            fn = implementation("attention", name).fn

            def call(q, k, v, fn=fn):
                return fn(q, k, v, causal=causal)
            try:
                with torch.no_grad():
                    err = relative_error(call(q[one], k[one], v[one]), want)
                    fwd_ms = bench(lambda: call(q, k, v))
                ms = bench(fwd_bwd(call, [q, k, v]))
            except Exception as e:  # e.g. a backend this device or shape lacks
                row[f"{name}_error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
                row["wrong"] = row.get("wrong", []) + ([name] if name in OURS else [])
                continue
            row[f"{name}_rel_err"] = err
            if not within(err, policy.ATTENTION, dtype):
                row["wrong"] = row.get("wrong", []) + [name]
            row[f"{name}_fwd_tflops"] = fwd_flops / fwd_ms / 1e9
            row[f"{name}_tflops"] = fwd_flops * 3.5 / ms / 1e9
            if peak:
                row[f"{name}_fwd_peak_pct"] = 100 * fwd_flops / fwd_ms / 1e-3 / peak
        if "triton_flash_tflops" in row and "sdpa_flash_tflops" in row:
            row["triton_vs_sdpa_flash"] = row["triton_flash_tflops"] / row["sdpa_flash_tflops"]
            row["target_met"] = row["triton_vs_sdpa_flash"] >= FLASH_TARGET
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fused_rows(dtype, bandwidth, tokens=16384, hidden=4096, ffn=11008, vocab=32000):
    from dr_scale.kernels import cross_entropy, cuda, policy, reference

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
    # whole-tensor passes over memory of one forward + backward (reads and writes of the
    # activation-sized tensors; weights and per-row statistics are small beside them)
    passes = {"rms_norm": 5, "layer_norm": 5, "swiglu": 8, "bias_gelu": 4, "rotary": 4,
              "cross_entropy": 3}
    policies = {"rms_norm": policy.NORM, "layer_norm": policy.NORM, "swiglu": policy.ELEMENTWISE,
                "bias_gelu": policy.ELEMENTWISE, "rotary": policy.ELEMENTWISE,
                "cross_entropy": policy.CROSS_ENTROPY}
    rows = []
    for name, (fast, ref, inputs) in cases.items():
        row = {"kernel": name, "dtype": str(dtype).replace("torch.", "")}
        try:
            with torch.no_grad():
                row["rel_err"] = relative_error(fast(*inputs),
                                                ref(*(x.float() if x.is_floating_point() else x
                                                      for x in inputs)))
            row.update(fused_ms=bench(fwd_bwd(fast, inputs)), torch_ms=bench(fwd_bwd(ref, inputs)))
        except Exception as e:  # ours: a failure of the check
            row.update(error=f"{type(e).__name__}: {e}"[:200], wrong=[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        if not within(row["rel_err"], policies[name], dtype):
            row["wrong"] = [name]
        row["speedup"] = row["torch_ms"] / row["fused_ms"]
        big = inputs[0]
        moved = passes[name] * big.numel() * big.element_size()
        row["fused_gb_s"] = moved / row["fused_ms"] / 1e6
        if bandwidth:
            row["fused_hbm_pct"] = 100 * row["fused_gb_s"] * 1e9 / bandwidth
            row["target_met"] = row["fused_hbm_pct"] >= HBM_TARGET
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def lm_head_row(dtype, tokens=4096, hidden=768, vocab=128256):
    """The fused LM head + cross-entropy (models/lm_head.py) at llama_125m's width and a Llama-3
    vocabulary, forward + backward, its chunks' softmax and gradient by the Triton kernels
    ("fused") against torch's (the matmuls are the same cuBLAS calls in both)."""
    from dr_scale.kernels import ops
    from dr_scale.models.lm_head import chunk_tokens, linear_cross_entropy

    h = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = 0.02 * torch.randn(vocab, hidden, device="cuda", dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    chunk = chunk_tokens(vocab)
    row = {"kernel": f"lm_head_loss (chunks of {chunk})", "dtype": str(dtype).replace("torch.", "")}
    try:
        for key, kernel in (("torch_ms", "torch"), ("fused_ms", "triton_fused")):
            ops.use_kernels("cuda", dtype, forced={**{op: "torch" for op in ops.OPS},
                                                   "cross_entropy": kernel})
            row[key] = bench(fwd_bwd(lambda h, w: linear_cross_entropy(h, w, labels, chunk),
                                     [h, w]))
        row["speedup"] = row["torch_ms"] / row["fused_ms"]
    except Exception as e:  # ours: a failure of the check
        row.update(error=f"{type(e).__name__}: {e}"[:200], wrong=["lm_head_loss"])
    finally:
        ops.reset()
    print(json.dumps(row), flush=True)
    return [row]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--full", action="store_true", help="full (non-causal) attention")
    p.add_argument("--out", default="bench_out/kernels")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_speed.py: needs a CUDA device (CPU correctness: "
                 "pytest tests/test_kernels_triton.py)")
    from dr_scale.train.peak_flops import datasheet_bandwidth, datasheet_peak

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    peak, bandwidth = datasheet_peak(device, "bf16"), datasheet_bandwidth(device)
    print(f"device: {device}; bf16 peak {peak and peak / 1e12} TFLOP/s, memory "
          f"{bandwidth and bandwidth / 1e12} TB/s (datasheet)", flush=True)
    rows = (attention_rows(a.seqs, a.head_dim, not a.full, torch.bfloat16, peak)
            + fused_rows(torch.bfloat16, bandwidth) + lm_head_row(torch.bfloat16))
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "results.md").write_text(markdown(rows, device) + "\n")
    print(markdown(rows, device))
    wrong = sorted({f"{r['kernel']}:{n}" for r in rows for n in r.get("wrong", [])})
    missed = sum(1 for r in rows if r.get("target_met") is False)
    met = sum(1 for r in rows if r.get("target_met") is True)
    print(f"kernels: speed targets met in {met} row(s), missed in {missed}")
    if wrong:
        sys.exit(f"kernels: beyond the precision policy or failed: {', '.join(wrong)}")
    print("kernels: every implementation within its precision policy")


def markdown(rows, device) -> str:
    lines = [f"device: {device}", "", "attention, TFLOP/s forward / forward+backward "
             "(% of bf16 peak, forward)", "",
             "| seq | heads | " + " | ".join(ATTENTION) + " | triton / SDPA flash (target "
             f"{FLASH_TARGET}) | largest error |", "|---|---|" + "---|" * (len(ATTENTION) + 2)]
    for r in rows:
        if r["kernel"] != "attention":
            continue
        cells = []
        for name in ATTENTION:
            if f"{name}_tflops" in r:
                pct = r.get(f"{name}_fwd_peak_pct")
                cells.append(f"{r[name + '_fwd_tflops']:.0f} / {r[name + '_tflops']:.0f}"
                             + (f" ({pct:.0f}%)" if pct else ""))
            else:
                cells.append("failed" if f"{name}_error" in r else "-")
        ratio = (f"{r['triton_vs_sdpa_flash']:.2f} ({'met' if r['target_met'] else 'missed'})"
                 if "triton_vs_sdpa_flash" in r else "-")
        errs = [r[f"{n}_rel_err"] for n in ATTENTION if f"{n}_rel_err" in r]
        worst = f"{max(errs):.1e}" + (f" (wrong: {', '.join(r['wrong'])})" if r.get("wrong")
                                      else "") if errs else "-"
        lines.append(f"| {r['seq']} | {r['heads']} | " + " | ".join(cells)
                     + f" | {ratio} | {worst} |")
    lines += ["", "| op (fwd+bwd) | fused ms | torch ms | speedup | fused GB/s | % of memory "
              f"bandwidth (target {HBM_TARGET:.0f}%) | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kernel"] == "attention":
            continue
        if "error" in r:
            lines.append(f"| {r['kernel']} | failed: {r['error']} | | | | | |")
            continue
        pct = (f"{r['fused_hbm_pct']:.0f}% ({'met' if r['target_met'] else 'missed'})"
               if "fused_hbm_pct" in r else "-")
        err = (f"{r['rel_err']:.1e}" + (" (beyond policy)" if r.get("wrong") else "")
               if "rel_err" in r else "-")
        gb_s = f"{r['fused_gb_s']:.0f}" if "fused_gb_s" in r else "-"  # the head: matmul-bound
        lines.append(f"| {r['kernel']} | {r['fused_ms']:.3f} | {r['torch_ms']:.3f} | "
                     f"{r['speedup']:.2f} | {gb_s} | {pct} | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
