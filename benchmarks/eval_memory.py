#!/usr/bin/env python
"""Evaluation costs no more memory than training: one model, one batch, the peak memory of a
training micro-step (forward + backward) beside an evaluation forward under torch.no_grad(),
each from a reset high-water mark (the mechanism behind mem_peak_bytes), per LM-head path.

    python benchmarks/eval_memory.py [--preset llama_125m] [--vocab_size 32000]
                                     [--micro_batch 2] [--seq_length 1024] [--chunks 512 0]
                                     [--out DIR]

Rows: per --chunks value, model.loss_chunk_tokens (0: whole logits, else the fused head). Peak is the
increase over the model's own memory (CPU: VmHWM; GPU: the allocator's peak). Writes
results.jsonl and results.md (the CPU model heads both).
"""
import argparse

import torch

from bench_results import write_results


def peak_over(fn, device_type: str) -> float:
    from dr_scale.train.metrics import peak_memory_bytes, reset_peak_memory

    reset_peak_memory(device_type)
    base = peak_memory_bytes(device_type)
    fn()
    return (peak_memory_bytes(device_type) - base) / 2 ** 20


def main(argv=None):
    from dr_scale.config import load_config
    from dr_scale.runtime.hardware import cpu_model
    from dr_scale.kernels import ops
    from dr_scale.models import build_model, resolve_shape

    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--preset", default="llama_125m")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=1024)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 0])
    p.add_argument("--out", default="benchmarks/results/eval_memory")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops.use_kernels(device, torch.float32, {})
    rows = []
    for chunk in a.chunks:
        cfg = load_config(None, [f"model.preset={a.preset}", f"model.vocab_size={a.vocab_size}",
                                 f"data.seq_length={a.seq_length}", "model.attention=sdpa",
                                 f"model.loss_chunk_tokens={chunk}"])
        shape = resolve_shape(cfg.model)
        model = build_model(shape).to(device)
        g = torch.Generator().manual_seed(0)
        batch = torch.randint(0, a.vocab_size, (a.micro_batch, a.seq_length + 1), generator=g)
        batch = batch.to(device)

        def train():
            model(batch[:, :-1], labels=batch[:, 1:]).backward()
            model.zero_grad(set_to_none=True)

        def evaluate():
            with torch.no_grad():
                model(batch[:, :-1], labels=batch[:, 1:])

        train()  # first-call allocations (kernels, autograd) out of the way
        train_mib = peak_over(train, device)
        eval_mib = peak_over(evaluate, device)
        rows.append({"head": "fused" if shape.loss_chunk else "whole logits",
                     "loss_chunk_tokens": shape.loss_chunk, "train_peak_mib": round(train_mib),
                     "eval_peak_mib": round(eval_mib), "eval_over_train": round(eval_mib / train_mib, 3)})
        print(rows[-1], flush=True)
    title = (f"# Evaluation against training peak memory, {a.preset} (vocabulary {a.vocab_size}),"
             f" {a.micro_batch} x {a.seq_length} tokens, fp32, {device} ({cpu_model()})")
    write_results(a.out, rows, title, [("LM head", "head"), ("chunk", "loss_chunk_tokens"),
                                       ("train step peak (MiB)", "train_peak_mib"),
                                       ("eval peak (MiB)", "eval_peak_mib"),
                                       ("eval / train", "eval_over_train")],
                  facts={"cpu": cpu_model(), "device": device})


if __name__ == "__main__":
    main()
