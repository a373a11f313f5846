#!/usr/bin/env python
"""Checkpoint saves, synchronous against asynchronous (train.async_save), side by side in one run:
how long the training loop waits for a save made in the middle of a run, what the step written
behind costs, and the whole run's wall time, start-up included.

    python benchmarks/checkpoint_save.py [--preset llama_1b] [--layers 4] [--ranks 1]
                                         [--out bench_out/checkpoint_save]

Modes: sync; async (train.async_save, writing from a snapshot in host memory, the default);
async_live (train.async_snapshot=false: the live tensors written behind step 3's forward and
backward, no second copy). Each mode trains 12 steps under ZeRO-3 (precision by what the CPU
computes natively: the bundled configs' bf16 "auto") and saves at steps 4 and 8 (mid-run: the
next steps run while an asynchronous save writes, 4 steps being longer than a write here, so a
save never waits for the one before; the first save of a run allocates the snapshot's buffers,
the second reuses them) and at step 12 (the end: nothing to hide behind, it waits in every
mode). Losses of the modes must be equal. Writes results.jsonl and results.md; the CPU model
heads both.
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


MODES = {"sync": ["train.async_save=false"],
         "async": ["train.async_save=true", "train.async_snapshot=true"],
         "async_live": ["train.async_save=true", "train.async_snapshot=false"]}


def run_mode(mode, preset, layers, ranks, seq, work):
    run = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work)) / "run"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero3", "--run_dir", str(run),
           f"model.preset={preset}", f"data.seq_length={seq}", "train.micro_batch_size=1",
           f"train.global_batch_size={ranks}", "train.max_steps=12", "train.save_interval=4",
           "train.warmup_steps=1", "train.eval_at_start=false", "train.eval_interval=1000",
           "train.log_interval=1", "logging.plot=false", "logging.tensorboard=false",
           *([f"model.num_layers={layers}"] if layers else []), *MODES[mode]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode}: the run failed ({proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    waited = {int(s): float(w) for s, w in WAITED.findall(proc.stdout)}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    size = sum(f.stat().st_size for f in (run / "checkpoints" / "step_00000012").rglob("*")
               if f.is_file())
    return {"mode": mode, "preset": preset, "layers": layers, "ranks": ranks, "seq_length": seq,
            "first_wait_s": waited[4], "mid_run_wait_s": waited[8], "final_wait_s": waited[12],
            "step3_s": round(steps[3]["step_time_s"], 2),
            "step9_s": round(steps[9]["step_time_s"], 2),
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
    ap.add_argument("--layers", type=int, default=4,
                    help="the preset cut to this many layers (0: as it is): a whole llama_1b "
                         "with Adam state does not fit these machines' disk next to a snapshot")
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--out", default="bench_out/checkpoint_save")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    shape = f"{a.preset}" + (f" cut to {a.layers} layers" if a.layers else "")
    print(f"checkpoint saves: {shape}, {a.ranks} rank(s), ZeRO-3, on {where}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as work:
        rows = []
        for mode in MODES:
            row = run_mode(mode, a.preset, a.layers, a.ranks, a.seq_length, work)
            print(f"  {mode:10s} loop waited: first save {row['first_wait_s']:.2f} s, second "
                  f"{row['mid_run_wait_s']:.2f} s; step 9 (written behind when async) "
                  f"{row['step9_s']:.2f} s (step 3: {row['step3_s']:.2f}); final save waited "
                  f"{row['final_wait_s']:.2f} s; wall {row['wall_s']:.1f} s; checkpoint "
                  f"{row['checkpoint_gib']} GiB", flush=True)
            rows.append(row)
    sync = rows[0]
    for row in rows[1:]:
        row["wait_vs_sync"] = round(row["mid_run_wait_s"] / sync["mid_run_wait_s"], 3)
        row["first_vs_sync"] = round(row["first_wait_s"] / sync["first_wait_s"], 3)
        print(f"{row['mode']}/sync wait of the second mid-run save: {row['wait_vs_sync']:.3f}x "
              f"(the first: {row['first_vs_sync']:.3f}x); step 9: "
              f"{row['step9_s'] / sync['step9_s']:.2f}x the synchronous run's; wall "
              f"{row['wall_s'] / sync['wall_s']:.2f}x; losses equal: "
              f"{sync['losses'] == row['losses']}")
        if sync["losses"] != row["losses"]:
            raise SystemExit(f"{row['mode']} trained differently from sync")
    write_results(a.out, rows, f"# Checkpoint saves, {shape}, ZeRO-3 on {a.ranks} rank(s) "
                  f"({where})",
                  [("mode", "mode"), ("first save: loop waited (s)", "first_wait_s"),
                   ("vs sync", "first_vs_sync"),
                   ("second save: loop waited (s)", "mid_run_wait_s"), ("vs sync", "wait_vs_sync"),
                   ("step 9 (s)", "step9_s"), ("final save waited (s)", "final_wait_s"),
                   ("wall (s)", "wall_s"), ("checkpoint (GiB)", "checkpoint_gib"),
                   ("peak RSS (GiB)", "peak_rss_gib")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
