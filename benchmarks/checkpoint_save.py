#!/usr/bin/env python
"""Checkpoint saves, synchronous against asynchronous (train.async_save), side by side in one run:
how long the training loop waits for a save made in the middle of a run, what the step written
behind costs, and the whole run's wall time, start-up included.

    python benchmarks/checkpoint_save.py [--preset llama_1b] [--ranks 1] [--out bench_out/ckpt]

Each mode trains 3 steps under ZeRO-3 (precision by what the CPU computes natively: the bundled
configs' bf16 "auto") and saves at step 2 (mid-run: step 3 runs while an asynchronous save
writes) and at step 3 (the end: nothing to hide behind, it waits in either mode). Losses of the
two modes must be equal. Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent
WAITED = re.compile(r"saved checkpoint \S+step_(\d+) \(the training loop waited ([\d.]+) s")


def run_mode(mode, preset, ranks, seq, work):
    run = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work)) / "run"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero3", "--run_dir", str(run),
           f"model.preset={preset}", f"data.seq_length={seq}", "train.micro_batch_size=1",
           f"train.global_batch_size={ranks}", "train.max_steps=3", "train.save_interval=2",
           "train.warmup_steps=1", "train.eval_at_start=false", "train.eval_interval=1000",
           "train.log_interval=1", "logging.plot=false", "logging.tensorboard=false",
           f"train.async_save={'true' if mode == 'async' else 'false'}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode}: the run failed ({proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    waited = {int(s): float(w) for s, w in WAITED.findall(proc.stdout)}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    size = sum(f.stat().st_size for f in (run / "checkpoints" / "step_00000002").rglob("*")
               if f.is_file())
    return {"mode": mode, "preset": preset, "ranks": ranks, "seq_length": seq,
            "mid_run_wait_s": waited[2], "final_wait_s": waited[3],
            "step2_s": round(steps[2]["step_time_s"], 2),
            "step3_s": round(steps[3]["step_time_s"], 2),
            "wall_s": round(wall, 1), "checkpoint_gib": round(size / 2**30, 2),
            "peak_rss_gib": round(max(r["mem_peak_bytes"] for r in steps.values()) / 2**30, 2),
            "losses": [steps[s]["loss"] for s in sorted(steps)]}


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--ranks", type=int, default=1,
                    help="1 on a 24 GiB machine: at 2 ranks each builds the whole model first "
                         "and llama_1b does not fit")
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--out", default="bench_out/checkpoint_save")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"checkpoint saves: {a.preset}, {a.ranks} rank(s), ZeRO-3, on {where}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as work:
        rows = []
        for mode in ("sync", "async"):
            row = run_mode(mode, a.preset, a.ranks, a.seq_length, work)
            print(f"  {mode:5s} mid-run save: loop waited {row['mid_run_wait_s']:.2f} s; step 3 "
                  f"(written behind when async) {row['step3_s']:.2f} s; final save waited "
                  f"{row['final_wait_s']:.2f} s; wall {row['wall_s']:.1f} s; checkpoint "
                  f"{row['checkpoint_gib']} GiB", flush=True)
            rows.append(row)
    sync, async_ = rows
    ratio = async_["mid_run_wait_s"] / sync["mid_run_wait_s"]
    print(f"async/sync wait of the mid-run save: {ratio:.3f}x; step written behind: "
          f"{async_['step3_s'] / sync['step3_s']:.2f}x the synchronous run's step 3; wall "
          f"{async_['wall_s'] / sync['wall_s']:.2f}x; losses equal: "
          f"{sync['losses'] == async_['losses']}")
    if sync["losses"] != async_["losses"]:
        raise SystemExit("the two modes trained differently")
    write_results(a.out, rows, f"# Checkpoint saves, {a.preset} ZeRO-3 on {a.ranks} rank(s) "
                  f"({where})",
                  [("mode", "mode"), ("mid-run save: loop waited (s)", "mid_run_wait_s"),
                   ("step 3 (s)", "step3_s"), ("final save waited (s)", "final_wait_s"),
                   ("wall (s)", "wall_s"), ("checkpoint (GiB)", "checkpoint_gib"),
                   ("peak RSS (GiB)", "peak_rss_gib")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
