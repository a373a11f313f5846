#!/usr/bin/env python
"""Logits never whole: the fused, chunked LM head + cross-entropy (models/lm_head.py) against the
whole logits, side by side in one run, each a real training run of the launcher (one rank, or a
tensor-parallel group of N, each rank holding a slice of the vocabulary).

    python benchmarks/lm_head_loss.py [--preset llama_125m] [--vocab_size 128256]
                                      [--micro_batch 4] [--seq_length 1024] [--chunks 0 512 2048]
                                      [--tensor_parallel 2]

`--chunks`: model.loss_chunk_tokens per run; 0 is the unfused path (whole logits), `auto` the
default rule. Per run: peak RSS of the fullest rank from process start to the last step (the model's
state is the same in every run, so the difference is the loss's), the median step time over the
steps after the first, and the losses (which must agree within the precision policy). Precision:
the config's bf16 "auto" (bf16 where the CPU computes it natively); the output says which.
Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def measured(a, chunk, work) -> dict:
    run = Path(tempfile.mkdtemp(prefix=f"chunk{chunk}-", dir=work)) / "run"
    chunk_arg = [] if chunk == "auto" else [f"model.loss_chunk_tokens={chunk}"]
    tp = a.tensor_parallel
    cmd = ["deepspeed", "--num_gpus", str(tp), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero1", "--run_dir", str(run),
           f"model.preset={a.preset}", f"model.vocab_size={a.vocab_size}", *chunk_arg,
           f"data.seq_length={a.seq_length}", f"train.micro_batch_size={a.micro_batch}",
           f"train.global_batch_size={a.micro_batch}", f"train.max_steps={a.steps}",
           "train.warmup_steps=1", "train.eval_at_start=false", "train.eval_interval=1000",
           "train.save_interval=1000", "train.log_interval=1", "logging.plot=false",
           "logging.tensorboard=false", f"parallel.tensor_parallel={tp}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"loss_chunk_tokens={chunk}: the run failed ({proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    precision = re.search(r"ZeRO-\d, (\w+)", proc.stdout).group(1)
    return {"chunk": chunk, "precision": precision,
            "peak_rss_gib": steps[-1]["mem_peak_bytes"] / 2**30,
            "step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
            "losses": [round(r["loss"], 5) for r in steps],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_125m")
    ap.add_argument("--vocab_size", type=int, default=128256)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--seq_length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--chunks", nargs="+", default=["0", "auto"])
    ap.add_argument("--tensor_parallel", type=int, default=1,
                    help="ranks of one tensor-parallel group (the vocabulary split over them)")
    ap.add_argument("--out", default="bench_out/lm_head_loss")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"LM head + loss: {a.preset}, vocabulary {a.vocab_size}, micro-batch {a.micro_batch} x "
          f"{a.seq_length}, {a.steps} steps a run, {a.tensor_parallel} rank(s) (tensor parallel), "
          f"on {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lm-head-bench-") as work:
        for chunk in a.chunks:
            row = measured(a, chunk, work)
            rows.append(row)
            print(f"  loss_chunk_tokens={chunk} ({row['precision']}): peak RSS "
                  f"{row['peak_rss_gib']:.2f} GiB, step {row['step_s']:.2f} s, losses "
                  f"{row['losses']}", flush=True)
    base = rows[0]
    for r in rows:
        r["memory_vs_first"] = round(r["peak_rss_gib"] / base["peak_rss_gib"], 3)
        r["time_vs_first"] = round(r["step_s"] / base["step_s"], 3)
        r["max_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], base["losses"]))
        r["peak_rss_gib"], r["step_s"] = round(r["peak_rss_gib"], 3), round(r["step_s"], 3)
    for r in rows[1:]:
        print(f"loss_chunk_tokens={r['chunk']} / {base['chunk']}: peak RSS "
              f"{r['memory_vs_first']:.2f}x, step time {r['time_vs_first']:.2f}x, largest loss "
              f"difference {r['max_loss_diff']:.2e}")
    write_results(a.out, rows, f"# LM head + cross-entropy, {a.preset} with a {a.vocab_size} "
                  f"vocabulary, {a.micro_batch} x {a.seq_length} tokens, tensor parallel "
                  f"{a.tensor_parallel} ({where})",
                  [("loss_chunk_tokens", "chunk"), ("precision", "precision"),
                   ("peak RSS (GiB)", "peak_rss_gib"), ("step (s)", "step_s"),
                   ("memory vs first", "memory_vs_first"), ("time vs first", "time_vs_first"),
                   ("largest loss difference", "max_loss_diff")], dict(cpu=where))


if __name__ == "__main__":
    main()
