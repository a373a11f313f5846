#!/usr/bin/env python
"""Converting a checkpoint to DeepSpeed's universal form (what a resume on another layout
does): DeepSpeed's ds_to_universal as it is (each worker loads a rank's file whole) against
`dr-scale reshard` (the same conversion, the files memory-mapped), 1 worker and K, side by side
in one run, on the same checkpoint.

    python benchmarks/reshard.py [--preset llama_1b] [--layers 4] [--zero_stage 1]
                                 [--from_ranks 2] [--to_ranks 1] [--workers 2]

Makes the checkpoint by training the preset cut to --layers one step on --from_ranks ranks,
then times each conversion and samples, every 0.1 s, the whole process tree's (the workers
included) summed RSS and summed anonymous memory (RssAnon: what the kernel cannot take back,
unlike the page cache a mapped file's pages stay in). The universal files must be byte-identical
between every row. From the per-element rate and the largest tensor it estimates other presets:
time scales with the checkpoint's elements; a worker's own memory with the largest tensor it
merges (its pieces and the joined tensor: 2 x 4 bytes an element). Writes results.jsonl and
results.md; the CPU model heads both.
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


def tree_memory(pid) -> tuple:
    """(summed RSS, summed RssAnon) of `pid` and its descendants, in bytes."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = anon = 0
    for p in procs:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
    return rss, anon


def timed(cmd):
    """(seconds, peak summed RSS, peak summed RssAnon of the process tree in bytes, stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0, 0]

    def sample():
        while proc.poll() is None:
            rss, anon = tree_memory(proc.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)
            time.sleep(0.1)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed:\n{err[-2000:]}")
    return time.perf_counter() - t0, peak[0], peak[1], out


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def preset_tensors(preset: str) -> tuple:
    """(elements of the preset's largest parameter, elements of all its parameters)."""
    from dr_scale.models.build import ModelShape, all_presets
    from dr_scale.parallel.estimate import largest_tensor, meta_model

    shape = ModelShape(**all_presets()[preset])
    return largest_tensor(shape), sum(p.numel() for p in meta_model(shape).parameters())


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--zero_stage", type=int, default=1)
    ap.add_argument("--from_ranks", type=int, default=2)
    ap.add_argument("--to_ranks", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--estimate", default="llama_7b,llama_70b")
    ap.add_argument("--out", default="bench_out/reshard")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as work:
        run = Path(work) / "run"
        cmd = ["deepspeed", "--num_gpus", str(a.from_ranks), "--master_port",
               str(29500 + os.getpid() % 900), str(ROOT / "launchers" / "pretrain.py"),
               "--ds_config", f"zero{a.zero_stage}", "--run_dir", str(run),
               f"model.preset={a.preset}", f"model.num_layers={a.layers}", "data.seq_length=64",
               "train.micro_batch_size=1", "train.max_steps=1", "train.eval_at_start=false",
               "logging.plot=false", "logging.tensorboard=false"]
        timed(cmd)
        tag = run / "checkpoints" / "step_00000001"
        size = sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())
        weights = _saved_weights(tag)
        elements, measured_biggest = sum(t.numel() for t in weights), max(t.numel() for t in weights)
        print(f"reshard: {a.preset} cut to {a.layers} layers ({elements / 1e6:.1f}M parameters), "
              f"ZeRO-{a.zero_stage} checkpoint of {a.from_ranks} ranks ({size / 2**30:.2f} GiB) "
              f"for {a.to_ranks} rank(s), on {where}", flush=True)
        rows, digests = [], []
        for tool in ("deepspeed", "dr_scale"):
            for workers in sorted({1, a.workers}):
                universal = run / "checkpoints" / "universal"
                shutil.rmtree(universal, ignore_errors=True)
                if tool == "deepspeed":
                    out = universal / "as_is"
                    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(tag), "--output_folder", str(out),
                           "--num_extract_workers", str(workers),
                           "--num_merge_workers", str(workers)]
                else:
                    cmd = [sys.executable, "-m", "dr_scale.cli", "reshard", "--run_dir", str(run),
                           "--ranks", str(a.to_ranks), "--workers", str(workers)]
                secs, rss, anon, _ = timed(cmd)
                zero = next(universal.rglob("zero"))
                written = sum(f.stat().st_size for f in zero.rglob("*") if f.is_file())
                digests.append(digest(zero))
                row = {"tool": tool, "workers": workers, "seconds": round(secs, 1),
                       "peak_rss_gib": round(rss / 2**30, 2),
                       "peak_anon_gib": round(anon / 2**30, 2),
                       "written_gib": round(written / 2**30, 2),
                       "checkpoint_gib": round(size / 2**30, 2),
                       "elements": elements, "ns_per_element": round(secs / elements * 1e9, 2),
                       "from_ranks": a.from_ranks, "to_ranks": a.to_ranks}
                print(f"  {tool} {workers} worker(s): {secs:.1f} s, peak RSS {rss / 2**30:.2f} "
                      f"GiB, anonymous {anon / 2**30:.2f} GiB (all processes), wrote "
                      f"{written / 2**30:.2f} GiB", flush=True)
                rows.append(row)
    same = len(set(digests)) == 1
    print(f"universal files identical in every row: {same}")
    if not same:
        raise SystemExit("the conversions wrote different files")
    ours = [r for r in rows if r["tool"] == "dr_scale"]
    one, many = ours[0], ours[-1]
    added = (many["peak_anon_gib"] - one["peak_anon_gib"]) / max(1, many["workers"] - 1)
    print(f"a worker's own memory here: {added:.2f} GiB a worker added; the largest tensor "
          f"joined is {measured_biggest / 1e6:.1f}M elements, 2 x 4 bytes of it "
          f"{8 * measured_biggest / 2**30:.2f} GiB (the bound default_workers plans with)")
    for preset in filter(None, a.estimate.split(",")):
        biggest, total = preset_tensors(preset)
        print(f"estimate {preset} ({total / 1e9:.1f}B parameters, largest tensor "
              f"{biggest / 1e6:.0f}M): {one['ns_per_element'] * total / 1e9 / 60:.0f} min with 1 "
              f"worker, {many['ns_per_element'] * total / 1e9 / 60:.0f} min with "
              f"{many['workers']} on this machine (time by elements; the disk and more workers "
              f"change it); a worker's own memory about {8 * biggest / 2**30:.1f} GiB beside "
              f"its imports (2 x 4 bytes of the largest tensor)")
    write_results(a.out, rows, f"# Converting {a.preset} cut to {a.layers} layers (ZeRO-"
                  f"{a.zero_stage}, {a.from_ranks} ranks) to the universal form ({where})",
                  [("tool", "tool"), ("workers", "workers"), ("seconds", "seconds"),
                   ("peak RSS, all processes (GiB)", "peak_rss_gib"),
                   ("peak anonymous (GiB)", "peak_anon_gib"),
                   ("written (GiB)", "written_gib")], dict(cpu=where))


def _saved_weights(tag: Path):
    """The model's tensors as saved (one tensor rank's, ZeRO-1/2's whole-model file or
    ZeRO-3's shapes)."""
    import torch

    files = sorted(tag.glob("*mp_rank_00_model_states.pt"))
    state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    if state.get("module"):
        return list(state["module"].values())
    return [torch.empty(shape, device="meta") for group in state["param_shapes"]
            for shape in group.values()]


if __name__ == "__main__":
    main()
