#!/usr/bin/env python
"""Streamed import: `model.init_from` of a sharded Hugging Face folder (made here by transformers'
save_pretrained with max_shard_size) on N ranks under ZeRO-3, against the same training run
started from a fresh initialisation, side by side in one run: each rank's peak RSS from process
start to the end of step 3, and the import's share of the start-up.

    python benchmarks/import_stream.py [--preset llama_1b] [--num_layers 8] [--ranks 2]
                                       [--max_shard_size 500MB]

The target: the import's peak per rank at most 1.10x training's. The folder is fp32 (the loader
reads each tensor into this rank's partition: a ZeRO-3 rank copies only its own slice). Logits of
an imported folder equal transformers' (tests/test_export.py). Writes results.jsonl and
results.md; the CPU model heads both.
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

from bench_results import write_results
from memory_scaling import measured


def make_folder(preset, layers, vocab, out: Path, max_shard_size: str) -> float:
    """A randomly initialised transformers model of our preset's shape, saved sharded; its size
    in GiB."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dr_scale.config import load_config
    from dr_scale.export.hf import hf_config
    from dr_scale.models import resolve_shape

    cfg = load_config(overrides=[f"model.preset={preset}", f"model.vocab_size={vocab}",
                                 *([f"model.num_layers={layers}"] if layers else [])])
    config = hf_config(resolve_shape(cfg.model), eod_id=vocab - 1)
    kind = config.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **config))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--num_layers", type=int, default=8,
                    help="cut the depth: llama_1b's 16 layers take 10.4 GiB a rank at 2 ranks "
                         "(benchmarks/memory_scaling.py), near all of a 24 GiB machine")
    ap.add_argument("--vocab_size", type=int, default=4096, help="the bundled tokenizer's")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--max_shard_size", default="500MB")
    ap.add_argument("--out", default="bench_out/import_stream")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"streamed import: {a.preset}, {a.num_layers} layers, ZeRO-3 on {a.ranks} rank(s), on "
          f"{where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="import-bench-", dir=os.environ.get("TMPDIR")) as work:
        folder = Path(work) / "hf"
        t0 = time.perf_counter()
        gib = make_folder(a.preset, a.num_layers, a.vocab_size, folder, a.max_shard_size)
        shards = len(list(folder.glob("*.safetensors")))
        print(f"  made {folder.name}: {gib:.2f} GiB fp32 in {shards} shards "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for label, extra in (("fresh initialisation", ()),
                             ("model.init_from", (f"model.init_from={folder}",))):
            row = measured("zero3", a.preset, a.seq_length, a.ranks, a.vocab_size, a.num_layers,
                           work, extra)
            row["start"] = label
            print(f"  {label}: peak RSS per rank {row['peak_rss_gib']:.2f} GiB (start-up "
                  f"included); losses {[round(x, 4) for x in row['losses']]}; wall "
                  f"{row['wall_s']:.0f} s", flush=True)
            rows.append(row)
    ratio = rows[1]["peak_rss_gib"] / rows[0]["peak_rss_gib"]
    print(f"import / fresh: peak RSS per rank {ratio:.2f}x (target <= 1.10x)")
    for r in rows:
        r["peak_rss_gib"] = round(r["peak_rss_gib"], 3)
    write_results(a.out, rows, f"# Streamed import, {a.preset} {a.num_layers} layers, ZeRO-3, "
                  f"{a.ranks} ranks ({where})",
                  [("start", "start"), ("precision", "precision"),
                   ("peak RSS per rank (GiB)", "peak_rss_gib"), ("wall (s)", "wall_s")],
                  dict(cpu=where, folder_gib=round(gib, 3), shards=shards,
                       import_over_fresh=round(ratio, 3)))


if __name__ == "__main__":
    main()
