#!/usr/bin/env python
"""Start-up: from the launcher's start to the first step, the step itself left out, as a user of
`deepspeed --num_gpus R launchers/pretrain.py` waits for it.

    python benchmarks/startup.py [--preset llama_1b] [--layers 8] [--ranks 1 2] [--repeats 1]
                                 [--out bench_out/startup]

Each point is one fresh launch under the bundled zero3 config (bf16 "auto"): the clock starts
when the `deepspeed` command is started and stops when the first step's record appears in the
run's metrics.jsonl; that record's own step time is subtracted. The launch is then stopped (its
end-of-run save is not start-up). Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import signal
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


def launch_to_first_step(preset, layers, ranks, work, timeout=1800):
    run = Path(tempfile.mkdtemp(prefix=f"r{ranks}-", dir=work)) / "run"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero3", "--run_dir", str(run),
           f"model.preset={preset}", f"model.num_layers={layers}", "data.seq_length=256",
           "train.micro_batch_size=1", f"train.global_batch_size={ranks}", "train.max_steps=2",
           "train.eval_at_start=false", "train.eval_interval=1000", "train.save_interval=1000",
           "train.log_interval=1", "logging.plot=false", "logging.tensorboard=false"]
    log = open(run.parent / "launch.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    ap.add_argument("--out", default="bench_out/startup")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"start-up: {a.preset} cut to {a.layers} layers, ZeRO-3, on {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as work:
        for _ in range(a.repeats):
            for ranks in a.ranks:
                row = launch_to_first_step(a.preset, a.layers, ranks, work)
                print(f"  {ranks} rank(s): start-up {row['startup_s']} s (step 1 took "
                      f"{row['step_s']} s)", flush=True)
                rows.append(row)
    write_results(a.out, rows, f"# Start-up to step 1, {a.preset} cut to {a.layers} layers, "
                  f"ZeRO-3 ({where})",
                  [("ranks", "ranks"), ("start-up (s)", "startup_s"), ("step 1 (s)", "step_s")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
