#!/usr/bin/env python
"""Resharding a ZeRO-3 checkpoint for another number of ranks: DeepSpeed's universal conversion
with 1 worker (what a resume did inside the job before) against K workers (`dr-scale reshard`),
side by side in one run, on the same checkpoint.

    python benchmarks/reshard.py [--layers 19] [--from_ranks 2] [--to_ranks 4] [--workers 2]

Makes the checkpoint by training a ~0.25B Llama (hidden 1024, 19 layers) one step under ZeRO-3,
then times `dr-scale reshard` for each worker count and samples the summed RSS of the whole
process tree (the workers included) every 0.1 s; the converted files must be byte-identical.
Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def tree_rss(pid) -> int:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def timed(cmd):
    """(seconds, peak summed RSS of the process tree in bytes, stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.1)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed:\n{err[-2000:]}")
    return time.perf_counter() - t0, peak[0], out


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--from_ranks", type=int, default=2)
    ap.add_argument("--to_ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default="bench_out/reshard")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as work:
        run = Path(work) / "run"
        cmd = ["deepspeed", "--num_gpus", str(a.from_ranks), "--master_port",
               str(29500 + os.getpid() % 900), str(ROOT / "launchers" / "pretrain.py"),
               "--ds_config", "zero3", "--run_dir", str(run), "model.preset=llama_125m",
               "model.hidden_size=1024", f"model.num_layers={a.layers}", "model.num_heads=16",
               "model.num_kv_heads=16", "model.ffn_hidden_size=2816", "data.seq_length=64",
               "train.micro_batch_size=1", "train.max_steps=1", "train.eval_at_start=false",
               "logging.plot=false", "logging.tensorboard=false"]
        seconds, _, out = timed(cmd)
        tag = run / "checkpoints" / "step_00000001"
        size = sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())
        params = re.search(r"\) ([\d.]+[MB]) parameters;", out).group(1)
        print(f"reshard: a {params}-parameter ZeRO-3 checkpoint of {a.from_ranks} ranks "
              f"({size / 2**30:.2f} GiB) for {a.to_ranks} ranks, on {where}", flush=True)
        rows, digests = [], []
        for workers in sorted({1, a.workers}):
            shutil.rmtree(run / "checkpoints" / "universal", ignore_errors=True)
            secs, peak, _ = timed([sys.executable, "-m", "dr_scale.cli", "reshard", "--run_dir",
                                   str(run), "--ranks", str(a.to_ranks), "--workers",
                                   str(workers)])
            made = run / "checkpoints" / "universal"
            written = sum(f.stat().st_size for f in made.rglob("*") if f.is_file())
            digests.append(digest(made))
            row = {"workers": workers, "seconds": round(secs, 1),
                   "peak_rss_gib": round(peak / 2**30, 2), "written_gib": round(written / 2**30, 2),
                   "checkpoint_gib": round(size / 2**30, 2), "parameters": params,
                   "from_ranks": a.from_ranks, "to_ranks": a.to_ranks}
            print(f"  {workers} worker(s): {secs:.1f} s, peak RSS (all processes) "
                  f"{peak / 2**30:.2f} GiB, wrote {written / 2**30:.2f} GiB", flush=True)
            rows.append(row)
    print(f"speed-up with {rows[-1]['workers']} workers: "
          f"{rows[0]['seconds'] / rows[-1]['seconds']:.2f}x; outputs identical: "
          f"{len(set(digests)) == 1}")
    if len(set(digests)) != 1:
        raise SystemExit("the worker counts wrote different files")
    write_results(a.out, rows, f"# Resharding a {params}-parameter ZeRO-3 checkpoint "
                  f"{a.from_ranks} -> {a.to_ranks} ranks ({where})",
                  [("workers", "workers"), ("seconds", "seconds"),
                   ("peak RSS, all processes (GiB)", "peak_rss_gib"),
                   ("written (GiB)", "written_gib")], dict(cpu=where))


if __name__ == "__main__":
    main()
