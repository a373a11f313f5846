#!/usr/bin/env python
"""AdamW against Muon on the same model, data and steps, side by side.

    python benchmarks/optimizers.py [--preset tiny] [--ranks 2] [--steps 300]
                                    [--eval_interval 25] [--out bench_out/optimizers]

Each optimizer is one launcher job: the bundled zero1 (AdamW: train.lr for every parameter) and
zero1_muon (Muon at train.muon_lr for the blocks' matrices, AdamW at train.lr for the rest; no
gradient clipping, which DeepSpeed would apply to Muon's update: AdamW runs without it too, so
the two differ by the optimizer only), bf16 where the CPU has it. Reported: the held-out loss at
equal steps (the last evaluation) and at equal training time (each curve read at the time the
faster run's last evaluation came, linearly between evaluations), the median step time, its
backward and optimizer_step phases (DeepSpeed's ZeRO-1/2 orthogonalise Muon's matrices while
they reduce the gradients, at the end of the backward, so Muon's cost shows there more than in
the step), each rank's peak memory, and the
optimizer state a rank keeps (its ZeRO shard file of the last checkpoint: fp32 master weights
and the optimizer's moments or momentum). A picture of both held-out curves, against steps and
against training time.

Writes results.jsonl, results.md and optimizers.png to --out; the CPU named in each.
"""
import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_results import write_results
from throughput import PRETRAIN, _port, _run

OPTIMIZERS = {"AdamW": "zero1", "Muon": "zero1_muon"}


def run(name, ds_config, a, workdir) -> dict:
    run_dir = Path(workdir) / name
    cmd = ["deepspeed", "--num_gpus", str(a.ranks), "--master_port", _port(), str(PRETRAIN),
           "--ds_config", ds_config, "--run_dir", str(run_dir), f"model.preset={a.preset}",
           f"train.max_steps={a.steps}", f"train.micro_batch_size={a.micro_batch}",
           f"data.seq_length={a.seq_length}", "train.log_interval=1",
           f"train.eval_interval={a.eval_interval}", f"train.eval_samples={a.eval_samples}",
           f"train.save_interval={a.steps}", f"train.warmup_steps={a.warmup}",
           "train.grad_clip=0", "logging.plot=false", "logging.tensorboard=false",
           "logging.step_breakdown=true"]
    print(f"  {name}: {' '.join(cmd[5:])}", flush=True)
    _run(cmd, a.ranks, name)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "step_time_s" in r]
    elapsed, clock = {0: 0.0}, 0.0  # training time at the end of each step
    for r in train:
        clock += r["step_time_s"]
        elapsed[r["step"]] = clock
    evals = [(r["step"], elapsed[r["step"]], r["eval_loss"]) for r in recs if "eval_loss" in r]
    shards = sorted((run_dir / "checkpoints" / f"step_{a.steps:08d}").glob(
        "*zero_pp_rank_*_optim_states.pt"))
    return {"optimizer": name, "ds_config": ds_config, "evals": evals,
            "last_eval_loss": evals[-1][2], "train_time_s": clock,
            "step_time_s": statistics.median(r["step_time_s"] for r in train[1:]),
            "backward_s": statistics.median(r["time_backward_s"] for r in train[1:]),
            "optimizer_step_s": statistics.median(r["time_optimizer_step_s"] for r in train[1:]),
            "mem_peak_bytes": max(r["mem_peak_bytes"] for r in train),
            "optimizer_state_bytes": max(f.stat().st_size for f in shards)}


def loss_at_time(evals, t: float) -> float:
    """The held-out curve (step, time, loss) read at training time `t`, linearly between
    evaluations."""
    for (_, t0, l0), (_, t1, l1) in zip(evals, evals[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / max(t1 - t0, 1e-12)
    return evals[-1][2]


def plot(rows, out: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in rows:
        steps, times, losses = zip(*r["evals"])
        by_step.plot(steps, losses, marker="o", markersize=3, label=r["optimizer"])
        by_time.plot(times, losses, marker="o", markersize=3, label=r["optimizer"])
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s)")
    by_step.set_ylabel("held-out loss")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "optimizers.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval_interval", type=int, default=25)
    ap.add_argument("--eval_samples", type=int, default=64)
    ap.add_argument("--out", default="bench_out/optimizers")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    title = (f"AdamW vs Muon: {a.preset}, {a.ranks} rank(s) ZeRO-1, {a.steps} steps of "
             f"{a.micro_batch * a.ranks} x {a.seq_length} tokens ({where})")
    print(title, flush=True)
    with tempfile.TemporaryDirectory(prefix="optimizers-bench-") as work:
        rows = [run(name, ds, a, work) for name, ds in OPTIMIZERS.items()]
    equal_time = min(r["train_time_s"] for r in rows)
    for r in rows:
        r["eval_loss_at_equal_time"] = loss_at_time(r["evals"], equal_time)
        print(f"  {r['optimizer']}: held-out {r['last_eval_loss']:.4f} at step {a.steps}, "
              f"{r['eval_loss_at_equal_time']:.4f} at {equal_time:.0f} s; step "
              f"{r['step_time_s'] * 1e3:.0f} ms (backward {r['backward_s'] * 1e3:.0f} ms, "
              f"optimizer {r['optimizer_step_s'] * 1e3:.0f} ms); optimizer state "
              f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB a rank",
              flush=True)
    out = Path(a.out)
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    write_results(out, rows, f"# {title}",
                  [("optimizer", "optimizer"),
                   (f"held-out loss at step {a.steps}", lambda r: f"{r['last_eval_loss']:.4f}"),
                   (f"held-out loss at {equal_time:.0f} s",
                    lambda r: f"{r['eval_loss_at_equal_time']:.4f}"),
                   ("step (ms)", lambda r: f"{r['step_time_s'] * 1e3:.0f}"),
                   ("backward (ms)", lambda r: f"{r['backward_s'] * 1e3:.0f}"),
                   ("optimizer step (ms)", lambda r: f"{r['optimizer_step_s'] * 1e3:.0f}"),
                   ("peak memory a rank (MiB)", lambda r: mib(r["mem_peak_bytes"])),
                   ("optimizer state a rank (MiB)", lambda r: mib(r["optimizer_state_bytes"]))],
                  dict(cpu=where, preset=a.preset, ranks=a.ranks, steps=a.steps))
    plot(rows, out, title)
    print(f"wrote {out / 'optimizers.png'}")


if __name__ == "__main__":
    main()
