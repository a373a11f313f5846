#!/usr/bin/env python
"""The optimizer step, by AdamW implementation and ZeRO stage, measured side by side.

    python benchmarks/optimizer_step.py [--presets tiny] [--stages 1 2 3] [--ranks 2]
                                        [--repeats 2] [--steps 15] [--out bench_out/optimizer]

Two parts, each implementation of the same AdamW (DeepSpeed's optimizer section choosing it):
  torch fused     "torch_adam": true, "fused": true     (the bundled configs)
  torch foreach   "torch_adam": true, "fused": false    (torch's multi-tensor path)
  DeepSpeed       "torch_adam": false                   (DeepSpeed's FusedAdam: on CPU its C++
                                                         AVX kernel, the one its CPU Adam uses;
                                                         built on first use)
1. The whole step in real runs: the bundled zeroN config with each optimizer section, --ranks
   ranks, bf16 where the CPU has it, runs interleaved and repeated; the trainer's
   `optimizer_step` phase (DeepSpeed's step: the gradient norm and clipping, the update, the
   copy back to the bf16 weights and their all-gather), the whole step, tokens/s, and the last
   logged loss (the same AdamW: the variants must agree to bf16 noise).
2. The update alone: the implementation's `step()` over one fp32 flat tensor of the size one
   rank's ZeRO partition has (the preset's parameters / --ranks: ZeRO's optimizers update flat
   partitions), with the threads a rank gets; median of 20 after 3 warm-up steps; and each
   implementation's parameters after 10 updates against torch's for-loop AdamW (fp32).
Writes results.jsonl and results.md (the CPU named) to --out.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_results import write_results
from throughput import ROOT, run_point

VARIANTS = {
    "torch fused": {"torch_adam": True, "fused": True},
    "torch foreach": {"torch_adam": True, "fused": False, "foreach": True},
    "DeepSpeed": {"torch_adam": False},
}
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_optimizer(variant: str, params):
    import torch

    if variant == "DeepSpeed":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **HYPER)
    options = VARIANTS[variant]
    return torch.optim.AdamW(params, fused=options.get("fused"), foreach=options.get("foreach"),
                             **HYPER)


def time_update(variant: str, elements: int, threads: int, repeats: int = 20) -> float:
    """Seconds of one `step()` of `variant` over a flat fp32 partition of `elements`."""
    import torch

    torch.set_num_threads(threads)
    param = torch.nn.Parameter(torch.randn(elements, generator=torch.Generator().manual_seed(0)))
    param.grad = torch.randn(elements, generator=torch.Generator().manual_seed(1)) * 1e-3
    opt = make_optimizer(variant, [param])
    for _ in range(3):  # the state is made at the first step; the page faults with it
        opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def update_agreement(elements: int = 1 << 16, steps: int = 10) -> dict:
    """Largest relative difference of each implementation's parameters from torch's for-loop
    AdamW after `steps` updates on the same gradients (fp32)."""
    import torch

    gen = torch.Generator().manual_seed(2)
    start = torch.randn(elements, generator=gen)
    grads = [torch.randn(elements, generator=gen) * 1e-2 for _ in range(steps)]

    def run(make):
        p = torch.nn.Parameter(start.clone())
        opt = make([p])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    ref = run(lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER))
    return {v: float(((run(lambda ps, v=v: make_optimizer(v, ps)) - ref).abs().max()
                      / ref.abs().max()))
            for v in VARIANTS}


def config_with(stage: int, variant: str, work: Path) -> str:
    """The bundled zero{stage}.json with `variant`'s optimizer section, written to `work`."""
    ds = json.loads((ROOT / "ds_configs" / f"zero{stage}.json").read_text())
    params = {k: v for k, v in ds["optimizer"]["params"].items()
              if k not in ("torch_adam", "fused", "foreach")}
    ds["optimizer"]["params"] = {**params, **VARIANTS[variant]}
    path = work / f"zero{stage}-{variant.replace(' ', '_')}.json"
    path.write_text(json.dumps(ds, indent=2))
    return str(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny"])
    p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--out", default="bench_out/optimizer")
    a = p.parse_args(argv)
    from dr_scale.runtime.hardware import cpu_model

    threads = max(1, (os.cpu_count() or 1) // a.ranks)
    cpu = cpu_model()
    rows, parameters = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for preset in a.presets:
            for stage in a.stages:
                runs = {v: [] for v in a.variants}
                for repeat in range(a.repeats):  # interleaved
                    for variant in a.variants:
                        print(f"{preset} zero{stage} {variant} (run {repeat + 1}) ...",
                              file=sys.stderr, flush=True)
                        runs[variant].append(run_point(
                            preset, config_with(stage, variant, work), a.ranks, a.steps,
                            a.seq_length, a.micro_batch_size, [], work))
                parameters[preset] = runs[a.variants[0]][0]["parameters"]
                base = statistics.median(r["tokens_per_s"] for r in runs[a.variants[0]])
                for variant, rs in runs.items():
                    med = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
                    rows.append({"part": "whole step", "preset": preset, "stage": stage,
                                 "variant": variant, "ranks": a.ranks, "repeats": len(rs),
                                 "optimizer_step_ms": 1e3 * med("time_optimizer_step_s"),
                                 "step_ms": 1e3 * med("step_time_s"),
                                 "tokens_per_s": med("tokens_per_s"),
                                 "vs_first": med("tokens_per_s") / base,
                                 "last_loss": [r["last_loss"] for r in rs]})
                    print(f"{preset} zero{stage} {variant}: optimizer step "
                          f"{rows[-1]['optimizer_step_ms']:.1f} ms of {rows[-1]['step_ms']:.1f}; "
                          f"{rows[-1]['tokens_per_s']:,.0f} tokens/s "
                          f"({rows[-1]['vs_first']:.3f}x); last loss {rows[-1]['last_loss']}",
                          flush=True)
    agreement = update_agreement()
    for preset in a.presets:  # after the runs: they give the parameter count
        elements = parameters[preset] // a.ranks
        for variant in a.variants:
            seconds = time_update(variant, elements, threads)
            rows.append({"part": "update alone", "preset": preset, "variant": variant,
                         "elements": elements, "threads": threads, "update_ms": 1e3 * seconds,
                         "ns_per_element": 1e9 * seconds / elements,
                         "vs_loop_max_rel": agreement[variant]})
            print(f"{preset} update alone, {variant}: {1e3 * seconds:.2f} ms over {elements:,} "
                  f"elements ({threads} threads)", flush=True)
    fmt = lambda key, spec: (lambda r: format(r[key], spec) if key in r else "")  # noqa: E731
    write_results(
        a.out, rows, f"Optimizer step on {cpu}, {os.cpu_count()} cores, {a.ranks} ranks "
        f"({a.micro_batch_size} x {a.seq_length} tokens a rank, medians of {a.repeats} "
        f"interleaved runs)",
        [("part", "part"), ("preset", "preset"), ("ZeRO", "stage"), ("AdamW", "variant"),
         ("update ms", fmt("update_ms", ".2f")), ("ns/element", fmt("ns_per_element", ".2f")),
         ("vs for-loop (max rel)", fmt("vs_loop_max_rel", ".1e")),
         ("optimizer step ms", fmt("optimizer_step_ms", ".1f")), ("step ms", fmt("step_ms", ".1f")),
         ("tokens/s", fmt("tokens_per_s", ",.0f")), ("vs torch fused", fmt("vs_first", ".3f")),
         ("last loss", lambda r: " ".join(f"{x:.4f}" for x in r.get("last_loss", [])))],
        facts={"cpu": cpu, "cores": os.cpu_count()})


if __name__ == "__main__":
    main()
