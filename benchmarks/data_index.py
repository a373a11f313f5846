#!/usr/bin/env python
"""The sample index at pretraining scale: build time and memory of the one process that builds
it, and the memory of a rank that maps it and reads samples.

    python benchmarks/data_index.py [--documents 244000000] [--seq 4096] [--folder /tmp/idx1t]

A synthetic dataset of --documents documents (lengths uniform in 1..2*seq, so about
documents x seq tokens: 1T at the defaults) is written as a real .idx and a sparse .bin (its
tokens are zeros the file system never stores). Then, each in a fresh process:
  build   what the first process to start does: validate the index, split, order, cumulative
          counts, the blend and every epoch's permutation for one pass over the data, into the
          cache (under its file lock)
  rank    what every other rank does: find the cache built and read 2,000 random samples
Both report wall time and peak RSS (VmHWM, start-up included) and the RSS the data pipeline
added over the bare interpreter with numpy and torch imported. Writes results.jsonl/.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench_results import write_results

STAGE = r"""
import json, os, sys, time
import numpy as np, torch
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, v = line.split(":", 1)
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out
before = status()
from dr_scale.config import load_config
from dr_scale.data.loader import build_sources, resolve_files
stage, prefix, tokenizer, seq, samples, cache = sys.argv[1:7]
cfg = load_config(overrides=[f"data.tokenizer={tokenizer}", f"data.datasets=[{{prefix: {prefix}}}]",
                             f"data.seq_length={seq}", "data.valid_fraction=0.0001",
                             f"data.cache_dir={cache}"])
t0 = time.perf_counter()
tok, specs = resolve_files(cfg.data)
src = build_sources(cfg.data, 1234, int(samples), 64, tok, specs)  # "rank": found built
built = time.perf_counter() - t0
read = 0.0
if stage == "rank":
    rng = np.random.default_rng(0)
    t1 = time.perf_counter()
    for p in rng.integers(0, len(src.train), 2000):
        assert src.train[int(p)].shape[0] == int(seq) + 1
    read = time.perf_counter() - t1
after = status()
print(json.dumps({"stage": stage, "seconds": round(built, 2), "read_2000_samples_s": round(read, 3),
                  "train_samples": len(src.train), "peak_rss": after["VmHWM"],
                  "rss": after["VmRSS"], "rss_anon": after["RssAnon"], "rss_file": after["RssFile"],
                  "rss_added": after["VmRSS"] - before["VmRSS"],
                  "rss_anon_added": after["RssAnon"] - before["RssAnon"]}))
"""


def write_dataset(prefix: Path, documents: int, seq: int, tokenizer):
    """A real .idx (sizes, pointers, document indices) and a sparse .bin of matching length."""
    from dr_scale.data.indexed import _HEADER, CODE_OF, MAGIC, VERSION

    rng = np.random.default_rng(0)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(np.uint16)], documents,
                             documents + 1))
        chunk, total = 1 << 24, 0
        sizes_all = []
        for lo in range(0, documents, chunk):
            sizes = rng.integers(1, 2 * seq, min(chunk, documents - lo), dtype=np.int32)
            f.write(sizes.tobytes())
            sizes_all.append(sizes)
        for sizes in sizes_all:
            pointers = (total + np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)])) * 2
            total += int(sizes.sum(dtype=np.int64))
            f.write(pointers.astype(np.int64).tobytes())
        for lo in range(0, documents + 1, chunk):
            f.write(np.arange(lo, min(lo + chunk, documents + 1), dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(total * 2)
    Path(f"{prefix}.meta.json").write_text(json.dumps({
        "documents": documents, "tokens": total, "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": tokenizer.sha256}))
    return total


def run_stage(stage, prefix, tokenizer_path, seq, samples, cache):
    proc = subprocess.run([sys.executable, "-c", STAGE, stage, str(prefix), str(tokenizer_path),
                           str(seq), str(samples), str(cache)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    from dr_scale.data.corpus import bundled_data
    from dr_scale.data.tokenizer import load_tokenizer
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--documents", type=int, default=244_000_000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--folder", default="/tmp/dr_scale_index_bench")
    ap.add_argument("--out", default="bench_out/data_index")
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_path, _ = bundled_data(os.environ.get("DR_SCALE_CACHE", "~/.cache/dr_scale"), 4096)
    tokenizer = load_tokenizer(tok_path)
    prefix = folder / "synthetic"
    t0 = time.perf_counter()
    tokens = write_dataset(prefix, a.documents, a.seq, tokenizer)
    print(f"wrote {prefix}.idx ({Path(f'{prefix}.idx').stat().st_size / 2**30:.2f} GiB) and a "
          f"sparse .bin: {a.documents:,} documents, {tokens:,} tokens in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    samples = tokens // (a.seq + 1)  # one pass over the data
    rows = []
    for stage in ("build", "rank"):
        r = run_stage(stage, prefix, tok_path, a.seq, samples, folder / "cache")
        rows.append(r)
        print(f"{stage:5s}: {r['seconds']:7.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB, "
              f"data pipeline added {r['rss_added'] / 2**30:.3f} GiB "
              f"(anonymous {r['rss_anon_added'] / 2**30:.3f} GiB)"
              + (f", 2,000 random samples read in {r['read_2000_samples_s']:.2f} s"
                 if stage == "rank" else ""), flush=True)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    write_results(a.out, rows, f"Sample index for {a.documents:,} documents, "
                  f"{tokens / 1e12:.2f}T tokens, {samples:,} samples of {a.seq} on {where}",
                  [("stage", "stage"), ("seconds", "seconds"),
                   ("peak RSS (GiB)", lambda r: f"{r['peak_rss'] / 2**30:.2f}"),
                   ("RSS added by data (GiB)", lambda r: f"{r['rss_added'] / 2**30:.3f}"),
                   ("of it anonymous", lambda r: f"{r['rss_anon_added'] / 2**30:.3f}")],
                  dict(cpu=where, documents=a.documents, tokens=tokens))


if __name__ == "__main__":
    sys.exit(main())
