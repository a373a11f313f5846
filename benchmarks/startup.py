#!/usr/bin/env python
"""Start-up: from the launcher's start to the first step, the step itself left out, as a user of
`deepspeed --num_gpus R launchers/pretrain.py` waits for it.

    python benchmarks/startup.py [--preset llama_1b] [--layers 8] [--ranks 1 2] [--repeats 1]
                                 [--against OTHER_CHECKOUT] [--out bench_out/startup]

Each point is one fresh launch under the bundled zero3 config (bf16 "auto"): the clock starts
when the `deepspeed` command is started and stops when the first step's record appears in the
run's metrics.jsonl; that record's own step time is subtracted. The launch is then stopped (its
end-of-run save is not start-up). `--against`: another checkout of the project (a git worktree of
an earlier commit), launched in turn with this one, repeat by repeat, and the ratio of medians
printed. Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def first_step(metrics: Path):
    if not metrics.exists():
        return None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # being written
            continue
        if record.get("step") == 1 and "step_time_s" in record:
            return record
    return None


def launch_to_first_step(preset, layers, ranks, work, root=ROOT, timeout=1800):
    run = Path(tempfile.mkdtemp(prefix=f"r{ranks}-", dir=work)) / "run"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(root / "launchers" / "pretrain.py"), "--ds_config", "zero3", "--run_dir", str(run),
           f"model.preset={preset}", f"model.num_layers={layers}", "data.seq_length=256",
           "train.micro_batch_size=1", f"train.global_batch_size={ranks}", "train.max_steps=2",
           "train.eval_at_start=false", "train.eval_interval=1000", "train.save_interval=1000",
           "train.log_interval=1", "logging.plot=false", "logging.tensorboard=false"]
    log = open(run.parent / "launch.log", "w")
    t0 = time.perf_counter()
    env = dict(os.environ)
    if root != ROOT:  # its own package first, ahead of the installed one
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(":")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        while time.perf_counter() - t0 < timeout:
            record = first_step(run / "metrics.jsonl")
            if record is not None:
                seen = time.perf_counter() - t0
                return {"preset": preset, "layers": layers, "ranks": ranks,
                        "startup_s": round(seen - record["step_time_s"], 1),
                        "step_s": round(record["step_time_s"], 2)}
            if proc.poll() is not None:
                raise SystemExit(f"{ranks} rank(s): the launch ended ({proc.returncode}) before "
                                 f"step 1: see {run.parent / 'launch.log'}")
            time.sleep(0.05)
        raise SystemExit(f"{ranks} rank(s): no step 1 within {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--against", type=Path,
                    help="another checkout of the project, launched in turn with this one")
    ap.add_argument("--out", default="bench_out/startup")
    a = ap.parse_args(argv)
    checkouts = [("this", ROOT)] + ([("against", a.against.resolve())] if a.against else [])
    for _, root in checkouts[1:]:
        _link_package_data(root)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"start-up: {a.preset} cut to {a.layers} layers, ZeRO-3, on {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as work:
        for _ in range(a.repeats):
            for ranks in a.ranks:
                for name, root in reversed(checkouts):  # the other one first: no warm-up bias
                    row = dict(launch_to_first_step(a.preset, a.layers, ranks, work, root),
                               checkout=name)
                    print(f"  {ranks} rank(s), {name} checkout: start-up {row['startup_s']} s "
                          f"(step 1 took {row['step_s']} s)", flush=True)
                    rows.append(row)
    if a.against:
        for ranks in a.ranks:
            ours, theirs = ([r["startup_s"] for r in rows
                             if r["ranks"] == ranks and r["checkout"] == name]
                            for name in ("this", "against"))
            print(f"  {ranks} rank(s): this / against, ratio of medians "
                  f"{statistics.median(ours) / statistics.median(theirs):.2f}x", flush=True)
    write_results(a.out, rows, f"# Start-up to step 1, {a.preset} cut to {a.layers} layers, "
                  f"ZeRO-3 ({where})",
                  [("ranks", "ranks"), ("checkout", "checkout"), ("start-up (s)", "startup_s"),
                   ("step 1 (s)", "step_s")],
                  dict(cpu=where))


def _link_package_data(root: Path):
    """A checkout run from its folder lacks what setup.py maps into the package (the kernels and
    the bundled DeepSpeed configs): link them in, as an editable install does."""
    for name in ("kernels", "ds_configs"):
        link = root / "dr_scale" / name
        if (root / name).is_dir() and not link.exists():
            link.symlink_to(root / name)


if __name__ == "__main__":
    main()
