#!/usr/bin/env python
"""Preprocessing throughput: 1 worker against N, side by side in one run, on a synthetic corpus
made from the bundled one (documents of ~4 KB, distinct by a prefix); output bytes compared.

    python benchmarks/preprocess.py [--mib 60] [--workers 2] [--out bench_out/preprocess]

For each tokenizer kind (the bundled sentencepiece model, and a byte-level BPE tokenizer.json
trained here), prints tokens/s and MB/s per worker count, the speed-up, and whether the .bin/.idx
are byte-identical. Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_results import write_results


def digest(prefix) -> str:
    h = hashlib.sha256()
    for ext in (".bin", ".idx"):
        h.update(Path(f"{prefix}{ext}").read_bytes())
    return h.hexdigest()


def make_corpus(path: Path, mib: float):
    from dr_scale.data.corpus import CORPUS

    chapters = [json.loads(line)["text"] for line in gzip.open(CORPUS, "rt")]
    target, written, k = mib * 2**20, 0, 0
    with open(path, "w") as f:
        while written < target:
            for c in chapters:
                line = json.dumps({"text": f"Document {k}. {c}"}) + "\n"
                f.write(line)
                written += len(line)
                k += 1
                if written >= target:
                    break


def timed_preprocess(corpus, tokenizer, out, workers):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "preprocess", "--input",
                           str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
                           "--workers", str(workers)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return seconds, json.loads(Path(f"{out}.meta.json").read_text())


def main(argv=None):
    from dr_scale.data.corpus import CORPUS, bundled_data
    from dr_scale.data.text_files import iter_documents
    from dr_scale.data.tokenizer import train_bpe_tokenizer
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--mib", type=float, default=60)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default="bench_out/preprocess")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        make_corpus(corpus, a.mib)
        size = corpus.stat().st_size
        sp_model, _ = bundled_data(os.environ.get("DR_SCALE_CACHE", "~/.cache/dr_scale"), 4096)
        bpe = train_bpe_tokenizer(iter_documents([CORPUS]), tmp / "bpe", 4096)
        for kind, tok in (("sentencepiece", sp_model), ("huggingface bpe", bpe)):
            results = {}
            for workers in (1, a.workers):
                seconds, meta = timed_preprocess(corpus, tok, tmp / f"{kind[:2]}{workers}", workers)
                results[workers] = (seconds, meta)
                rows.append({"tokenizer": kind, "workers": workers, "seconds": round(seconds, 2),
                             "tokens": meta["tokens"], "tokens_per_s": round(meta["tokens"] / seconds),
                             "mb_per_s": round(size / 1e6 / seconds, 2)})
                print(f"{kind:16s} {workers} worker(s): {seconds:6.1f} s, "
                      f"{rows[-1]['tokens_per_s']:>10,} tokens/s, {rows[-1]['mb_per_s']} MB/s",
                      flush=True)
            same = digest(tmp / f"{kind[:2]}1") == digest(tmp / f"{kind[:2]}{a.workers}")
            speedup = results[1][0] / results[a.workers][0]
            rows[-1].update(speedup=round(speedup, 2), identical_to_1_worker=same)
            print(f"{kind:16s} speed-up {speedup:.2f}x with {a.workers} workers; output "
                  f"{'byte-identical' if same else 'DIFFERENT'} to 1 worker's", flush=True)
    write_results(a.out, rows, f"Preprocessing {size / 2**20:.1f} MiB of JSON lines (wall time, "
                  f"start-up included) on {where}",
                  [("tokenizer", "tokenizer"), ("workers", "workers"), ("seconds", "seconds"),
                   ("tokens/s", lambda r: f"{r['tokens_per_s']:,}"), ("MB/s", "mb_per_s"),
                   ("speed-up", "speedup"), ("identical", "identical_to_1_worker")],
                  dict(cpu=where, corpus_mib=round(size / 2**20, 1)))


if __name__ == "__main__":
    sys.exit(main())
