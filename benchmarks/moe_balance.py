#!/usr/bin/env python
"""Load balancing without a loss (DeepSeek-V3's routing bias) against the auxiliary loss, from
the same skewed start.

    python benchmarks/moe_balance.py [--preset moe_tiny] [--ranks 2] [--skew_steps 40]
                                     [--steps 200] [--rate 0.01] [--aux 0.01] [--seed 1234]
                                     [--out bench_out/moe_balance]

The skewed start: one job trains `skew_steps` steps with no balancing at all (no auxiliary loss,
the bias frozen at zero), which lets the router collapse onto a few experts, and saves. Two
jobs resume from copies of that checkpoint for `steps` more steps each: one with the auxiliary
loss (`aux` per layer, the bias frozen), one with the bias moving by `rate` a step and no
auxiliary loss. Both keep the routing bias in the model (model.moe.expert_bias=true), so the
three jobs have one weight layout and the resumes are plain ones.

Reported per run: the busiest expert's load over the mean (the worst layer) at the start,
the step at which every layer first came within 1.3x, the mean over the last 20 logged steps,
and the held-out loss at the end; a picture of both runs' load against the step
(moe_balance.png). Writes results.jsonl, results.md and moe_balance.png to --out; the CPU
named.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench_results import write_results
from throughput import PRETRAIN, _port, _run

TARGET = 1.3


def job(name, run_dir: Path, a, steps: int, aux: float, rate: float, resume: bool):
    cmd = ["deepspeed", "--num_gpus", str(a.ranks), "--master_port", _port(), str(PRETRAIN),
           "--ds_config", "zero2", "--run_dir", str(run_dir), f"model.preset={a.preset}",
           "model.moe.expert_bias=true", f"model.moe.aux_loss_coeff={aux}",
           f"model.moe.bias_update_rate={rate}", f"train.max_steps={steps}",
           f"train.micro_batch_size={a.micro_batch}", f"data.seq_length={a.seq_length}",
           "train.log_interval=2", f"train.eval_interval={steps}",
           f"train.eval_samples={a.eval_samples}", f"train.save_interval={steps}",
           "train.warmup_steps=10", f"train.seed={a.seed}", "logging.plot=false",
           "logging.tensorboard=false"]
    if resume:
        cmd += ["--resume", "auto"]
    print(f"  {name}: {' '.join(cmd[5:])}", flush=True)
    _run(cmd, a.ranks, name)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(name, recs, start: int) -> dict:
    loads = [(r["step"], max(r["expert_load"])) for r in recs
             if "expert_load" in r and r["step"] > start]
    within = next((s for s, load in loads if load <= TARGET), None)
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    return {"run": name, "loads": loads, "start_load": loads[0][1],
            "steps_to_target": None if within is None else within - start,
            "last_load": statistics.mean(load for _, load in loads[-10:]),
            "eval_loss": evals[-1]}


def plot(rows, out: Path, title: str, start: int):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        steps, loads = zip(*r["loads"])
        ax.plot(steps, loads, label=f"{r['run']} (held-out {r['eval_loss']:.3f})")
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1, label=f"{TARGET}x the mean")
    ax.axvline(start, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean (worst layer)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "moe_balance.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="moe_tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--skew_steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--eval_samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234, help="train.seed of all three jobs")
    ap.add_argument("--out", default="bench_out/moe_balance")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    total = a.skew_steps + a.steps
    title = (f"Balancing from a skewed start: {a.preset}, {a.ranks} rank(s) ZeRO-2, "
             f"{a.skew_steps} unbalanced steps then {a.steps} of {a.micro_batch * a.ranks} x "
             f"{a.seq_length} tokens\n({where})")
    print(title, flush=True)
    with tempfile.TemporaryDirectory(prefix="moe-balance-bench-") as work:
        work = Path(work)
        job("skewed start", work / "start", a, a.skew_steps, aux=0.0, rate=0.0, resume=False)
        rows = []
        for name, aux, rate in ((f"auxiliary loss {a.aux}", a.aux, 0.0),
                                (f"routing bias, rate {a.rate}", 0.0, a.rate)):
            run = work / name.split()[0]
            shutil.copytree(work / "start", run)
            rows.append(summary(name, job(name, run, a, total, aux, rate, resume=True),
                                a.skew_steps))
    for r in rows:
        print(f"  {r['run']}: load {r['start_load']:.2f} -> {r['last_load']:.2f} (within "
              f"{TARGET}x after {r['steps_to_target']} steps); held-out {r['eval_loss']:.4f}",
              flush=True)
    out = Path(a.out)
    write_results(out, rows, f"# {title.replace(chr(10), ' ')}",
                  [("run", "run"), ("load at the start", lambda r: f"{r['start_load']:.2f}"),
                   (f"steps to <= {TARGET}x", lambda r: r["steps_to_target"] or "not reached"),
                   ("load, last 10 records", lambda r: f"{r['last_load']:.2f}"),
                   (f"held-out loss at step {total}", lambda r: f"{r['eval_loss']:.4f}")],
                  dict(cpu=where, preset=a.preset, ranks=a.ranks, seed=a.seed))
    plot(rows, out, title, a.skew_steps)
    print(f"wrote {out / 'moe_balance.png'}")


if __name__ == "__main__":
    main()
