#!/usr/bin/env python
"""Can data ever be the bottleneck? The loader alone against a training step, side by side.

    python benchmarks/data_loader.py [--seq 2048] [--micro 8] [--steps 40] [--preset tiny ...]

Three datasets (the bundled corpus cut into documents of two sentences, in thirds) blended
0.5 / 0.3 / 0.2, with document masks and positions computed per batch as the trainer does:
  loader    tokens/s one rank's loader delivers (num_workers 0 and 2), the DataLoaderProfiler's
            fetch + collate figures beside the measured wall time (they should agree)
  training  tokens/s one rank trains at on the same batches (forward, backward, AdamW step; one
            process, the run's precision by hardware), per preset
The ratio loader / training says how much faster than training the data path is. Writes
results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_results import write_results


def make_datasets(folder: Path, tokenizer):
    from dr_scale.data.corpus import CORPUS
    from dr_scale.data.preprocess import preprocess

    chapters = [json.loads(line)["text"] for line in gzip.open(CORPUS, "rt")]
    sentences = [s for c in chapters for s in re.split(r"(?<=\.) ", c)]
    docs = [" ".join(sentences[i:i + 2]) for i in range(0, len(sentences) - 1, 2)]
    prefixes = []
    for k in range(3):
        src = folder / f"part{k}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[k::3]))
        preprocess([src], tokenizer, folder / f"part{k}", progress=False)
        prefixes.append(folder / f"part{k}")
    return prefixes


def loader_rate(sources, seq, micro, steps, workers, documents):
    from dr_scale.callbacks.dataloader_profiler import DataLoaderProfiler
    from dr_scale.data.loader import train_loader

    layout = {"micro": micro, "accum": 1, "global": micro}
    loader = train_loader(sources.train, layout, 1, 0, 0, steps, workers)
    with DataLoaderProfiler() as prof:
        t0 = time.perf_counter()
        for batch in prof.wrap(loader):
            documents.model_inputs(batch[:, :-1])
        seconds = time.perf_counter() - t0
    st = prof.stats()
    return steps * micro * seq / seconds, st


def training_rate(preset, sources, seq, micro, steps, documents, dtype):
    from dr_scale.config import load_config
    from dr_scale.kernels import ops
    from dr_scale.models import build_model, resolve_shape

    shape = resolve_shape(load_config(overrides=[f"model.preset={preset}"]).model,
                          sources.tokenizer.vocab_size)
    ops.reset()
    torch.manual_seed(0)
    model = build_model(shape).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.stack([sources.train[p] for p in range(s * micro, (s + 1) * micro)])
               for s in range(steps + 1)]

    def step(batch):
        inputs = batch[:, :-1]
        loss = model(inputs, batch[:, 1:], **documents.model_inputs(inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(batches[0])  # warm-up
    t0 = time.perf_counter()
    for b in batches[1:]:
        step(b)
    return steps * micro * seq / (time.perf_counter() - t0)


def main(argv=None):
    from dr_scale.config import load_config
    from dr_scale.data.corpus import bundled_data
    from dr_scale.data.documents import DocumentBoundaries
    from dr_scale.data.loader import build_sources, resolve_files
    from dr_scale.data.tokenizer import load_tokenizer
    from dr_scale.runtime.hardware import bf16_support, cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--train_steps", type=int, default=3)
    ap.add_argument("--preset", nargs="+", default=["tiny"], help="llama_125m too: minutes on CPU")
    ap.add_argument("--out", default="bench_out/data_loader")
    a = ap.parse_args(argv)
    native_bf16 = bf16_support("cuda" if torch.cuda.is_available() else "cpu").native
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    where = f"{cpu_model()}, {torch.get_num_threads()} thread(s)"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok_path, _ = bundled_data(os.environ.get("DR_SCALE_CACHE", "~/.cache/dr_scale"), 4096)
        tokenizer = load_tokenizer(tok_path)
        prefixes = make_datasets(tmp, tokenizer)
        datasets = ", ".join(f"{{prefix: {p}, weight: {w}}}" for p, w in zip(prefixes, (0.5, 0.3, 0.2)))
        cfg = load_config(overrides=[f"data.tokenizer={tok_path}", f"data.datasets=[{datasets}]",
                                     f"data.seq_length={a.seq}", f"data.cache_dir={tmp / 'cache'}"])
        tok, specs = resolve_files(cfg.data)
        samples = max(a.steps, a.train_steps + 1) * a.micro
        sources = build_sources(cfg.data, 1234, samples, 8, tok, specs)
        documents = DocumentBoundaries(tokenizer.eod_id, True, True)
        for workers in (0, 2):
            rate, st = loader_rate(sources, a.seq, a.micro, a.steps, workers, documents)
            work = st["fetch_s"] + st["collate_s"]
            rows.append({"what": f"loader, {workers} workers", "tokens_per_s": round(rate),
                         "profiler_fetch_collate_s": round(work, 3), "wall_s": round(st["wall_s"], 3)})
            print(f"loader ({workers} workers): {rate:,.0f} tokens/s; profiler: fetch + collate "
                  f"{work:.2f} s of {st['wall_s']:.2f} s wall, wait {st['wait_s']:.2f} s", flush=True)
        loader_best = max(r["tokens_per_s"] for r in rows)
        for preset in a.preset:
            rate = training_rate(preset, sources, a.seq, a.micro, a.train_steps, documents, dtype)
            rows.append({"what": f"training {preset} ({str(dtype).split('.')[-1]})",
                         "tokens_per_s": round(rate), "loader_over_training": round(loader_best / rate, 1)})
            print(f"training {preset}: {rate:,.0f} tokens/s; the loader delivers "
                  f"{loader_best / rate:,.1f}x that", flush=True)
    write_results(a.out, rows, f"Loader alone (3 datasets blended, document masks) against "
                  f"training, one rank, batch {a.micro} x {a.seq}, on {where}",
                  [("what", "what"), ("tokens/s", lambda r: f"{r['tokens_per_s']:,}"),
                   ("loader / training", "loader_over_training"),
                   ("profiler fetch+collate s", "profiler_fetch_collate_s"), ("wall s", "wall_s")],
                  dict(cpu=where, seq=a.seq, micro=a.micro))


if __name__ == "__main__":
    sys.exit(main())
