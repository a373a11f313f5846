#!/usr/bin/env python
"""ZeRO-Infinity resumes and exports exactly: `--ds_config zero3_nvme` on N ranks, 6 steps
uninterrupted against 3 steps, stop, `--resume`, 3 more, side by side in one run; the losses must
be equal bit for bit (as every other ZeRO config's are, tests/test_crash_resume.py), and
`dr-scale export` of the two final checkpoints (whose fp32 weights are DeepSpeed's swap files)
must write identical weights. Not in the test suite: it needs libaio and DeepSpeed's async_io op, whose first
build takes minutes (README: Optimizer state on NVMe).

    python benchmarks/nvme_resume.py [--ranks 2] [--preset tiny]

Exit status 1 when the losses or the exported weights differ. Writes results.jsonl and results.md; the CPU model heads
both.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def launch(ranks, run, extra):
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", "zero3_nvme", "--run_dir",
           str(run), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(extra)}: the run failed ({proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return time.perf_counter() - t0


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", default="bench_out/nvme_resume")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"NVMe resume: {a.preset}, zero3_nvme on {a.ranks} rank(s), on {where}", flush=True)
    args = [f"model.preset={a.preset}", "train.max_steps=6", "train.save_interval=3",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_at_start=false",
            "logging.plot=false", "logging.tensorboard=false",
            f"train.global_batch_size={8 * a.ranks}"]
    with tempfile.TemporaryDirectory(prefix="nvme-resume-", dir=os.environ.get("TMPDIR")) as work:
        full, split = Path(work) / "full", Path(work) / "split"
        wall = {"uninterrupted": launch(a.ranks, full, args)}
        wall["first 3 steps"] = launch(a.ranks, split, [*args, "--stop_at_step", "3"])
        wall["--resume"] = launch(a.ranks, split, ["--resume"])
        ref, got = losses(full), losses(split)
        for run in (full, split):
            subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir",
                            str(run), "--out", str(run / "hf")], check=True, capture_output=True)
        weights = [(run / "hf" / "model.safetensors").read_bytes() for run in (full, split)]
    exported_equal = weights[0] == weights[1]
    same = ref == got and exported_equal
    print(f"  uninterrupted: {ref}\n  stopped at 3, resumed: {got}\n  "
          f"{'equal bit for bit' if ref == got else 'DIFFERENT'}; exported weights "
          f"{'identical' if exported_equal else 'DIFFERENT'}; wall "
          + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))
    rows = [{"run": k, "wall_s": round(v, 1)} for k, v in wall.items()]
    write_results(a.out, rows, f"# NVMe resume, {a.preset}, {a.ranks} ranks ({where})",
                  [("run", "run"), ("wall (s)", "wall_s")],
                  dict(cpu=where, losses_uninterrupted=ref, losses_resumed=got, equal=same,
                       exported_identical=exported_equal))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
