#!/usr/bin/env python
"""The memory estimator against measured peaks, side by side, one job per layout.

    python benchmarks/estimate_check.py [--layouts NAME ...] [--out bench_out/estimate]

Small layouts (the tiny preset widened) train a few steps under each ZeRO stage, TP and
checkpointing. The llama_1b layouts (cut to 8 layers, the bundled tokenizer's 4,096 vocabulary:
the full depth takes 10.4 GiB a rank at 2 ranks, near all of a 24 GiB machine) are the
big-model paths: ZeRO-3 on 2 and on 4 ranks (memory that falls with ranks; as bundled, and with
at most 1e8 gathered parameters and freed pages trimmed), ZeRO-Infinity with the optimizer state
on NVMe (needs libaio) and with the parameters too, the same run started from a sharded Hugging
Face folder (model.init_from, streamed into each rank's partition), and `dr-scale export` of its
checkpoint. The measured peak (max over ranks of the resident set from process start, start-up
included; for the export, the export process's) is set beside `dr-scale estimate`'s `peak` (and
`export_peak`) for the same settings. Writes results.jsonl and results.md; the CPU model heads
both.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_results import write_results  # noqa: E402
from import_stream import make_folder  # noqa: E402
from memory_scaling import config_variant, estimated, fewer_live, measured  # noqa: E402
from throughput import run_point  # noqa: E402

SEQ, MICRO = 256, 4
SHAPE = ["model.hidden_size=512", "model.num_layers=6", "model.num_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=1408"]  # on the tiny preset
SMALL = {  # name: (ds_config, ranks, overrides)
    "zero0_2r": ("zero0", 2, []),
    "zero1_2r": ("zero1", 2, []),
    "zero3_2r": ("zero3", 2, []),
    "zero1_tp2": ("zero1", 2, ["parallel.tensor_parallel=2"]),
    "zero1_pp2": ("zero1", 2, ["parallel.pipeline_parallel=2"]),
    "zero2_1r_ckpt": ("zero2", 1, ["parallel.activation_checkpointing=full"]),
}
BIG_PRESET, BIG_LAYERS, BIG_VOCAB, BIG_SEQ = "llama_1b", 8, 4096, 256
BIG = {  # name: (ds_config, ranks, what the run starts from)
    "llama_1b_8l_zero3_2r": ("zero3", 2, "fresh"),
    "llama_1b_8l_zero3_4r": ("zero3", 4, "fresh"),
    # memory that falls with ranks (README): at most 1e8 gathered parameters, freed pages trimmed
    "llama_1b_8l_zero3_lean_2r": ("zero3", 2, "lean"),
    "llama_1b_8l_zero3_lean_4r": ("zero3", 4, "lean"),
    "llama_1b_8l_zero3_nvme_2r": ("zero3_nvme", 2, "fresh"),
    # parameters on NVMe too, DeepSpeed's defaults (max_in_cpu 1e9: the partition stays in memory)
    "llama_1b_8l_zero3_nvme_params_2r": ("zero3_nvme", 2, "params_nvme"),
    "llama_1b_8l_zero3_2r_init_from": ("zero3", 2, "folder"),
    "llama_1b_8l_export": ("zero3", 2, "export"),
}


def small(name, work) -> dict:
    from throughput import estimate_bytes

    ds, ranks, extra = SMALL[name]
    row = run_point("tiny", ds, ranks, 4, SEQ, MICRO, SHAPE + extra, work, log_interval=1)
    estimate = estimate_bytes("tiny", ds, ranks, SEQ, MICRO, SHAPE + extra, row["vocab_size"],
                              "cpu", key="peak")
    return {"measured_bytes": row["mem_peak_bytes"], "estimate_bytes": estimate}


def big(name, work) -> dict:
    ds, ranks, start = BIG[name]
    extra = []
    if start == "folder":
        folder = Path(work) / "hf"
        if not folder.exists():
            make_folder(BIG_PRESET, BIG_LAYERS, BIG_VOCAB, folder, "500MB")
        extra = [f"model.init_from={folder}"]
    if start == "export":
        extra = ["train.save_interval=3"]
    if start == "lean":
        ds, extra = fewer_live(ds, 1e8, work), ["train.release_host_memory=true"]
    if start == "params_nvme":
        ds = config_variant(ds, "params", work,
                            offload_param={"device": "nvme", "nvme_path": "auto"})
    row = measured(ds, BIG_PRESET, BIG_SEQ, ranks, BIG_VOCAB, BIG_LAYERS, work, extra)
    if "refused" in row:  # nothing measured to set beside the estimate
        raise SystemExit(f"{ds}, {ranks} ranks: {row['refused']}")
    estimate = estimated(ds, BIG_PRESET, BIG_SEQ, ranks, BIG_VOCAB, BIG_LAYERS,
                         extra)["bytes_per_rank"]
    if start != "export":
        return {"measured_bytes": int(row["peak_rss_gib"] * 2**30),
                "estimate_bytes": estimate["peak"]}
    out = Path(work) / "export"
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir",
                           str(row["run_dir"]), "--out", str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"export failed:\n{proc.stderr[-2000:]}")
    peak = float(re.search(r"peak RSS ([\d.]+) GiB", proc.stdout).group(1))
    return {"measured_bytes": int(peak * 2**30), "estimate_bytes": estimate["export_peak"]}


def main():
    from dr_scale.runtime.hardware import cpu_model

    names = list(SMALL) + list(BIG)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=names, choices=names)
    p.add_argument("--out", default="bench_out/estimate")
    a = p.parse_args()
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    print(f"estimate against measured peaks, on {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="estimate-check-", dir=os.environ.get("TMPDIR")) as work:
        for name in a.layouts:
            row = {"layout": name, **(small(name, work) if name in SMALL else big(name, work))}
            row["ratio"] = round(row["estimate_bytes"] / row["measured_bytes"], 3)
            rows.append(row)
            print(f"{name:<32} measured {row['measured_bytes'] / 2**20:8.0f} MiB  estimated "
                  f"{row['estimate_bytes'] / 2**20:8.0f} MiB  ratio {row['ratio']:.3f}",
                  flush=True)
    mib = lambda key: lambda r: round(r[key] / 2**20)  # noqa: E731
    write_results(a.out, rows, f"# Estimated against measured peak per rank ({where})",
                  [("layout", "layout"), ("measured MiB", mib("measured_bytes")),
                   ("estimated MiB", mib("estimate_bytes")), ("estimate / measured", "ratio")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
