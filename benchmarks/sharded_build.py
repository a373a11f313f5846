#!/usr/bin/env python
"""Start-up memory of tensor- and pipeline-parallel builds, side by side in one run: llama_1b
(the full preset shape) on 2 gloo ranks of this machine, split by TP 2 or cut by PP 2, built the
way every rank did before (the whole model in fp32, then split or cut, then cast) against built
on the meta device and made real only where this rank keeps it (parallel/sharded_build.py), in
the training precision. Each rank's peak RSS from process start until its part of the model is
ready (the largest over the ranks), beside `dr-scale estimate`'s start-up figure for the run.

    python benchmarks/sharded_build.py [--preset llama_1b] [--out bench_out/sharded_build]

Precision: bf16 where this CPU computes it natively, else fp32 (as the bundled configs' "auto").
Writes results.jsonl and results.md; the CPU model heads both.
"""
import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_results import write_results  # noqa: E402

LAYOUTS = {"TP 2": {"tensor": 2}, "PP 2": {"pipeline": 2}}


def rank_main(rank, port, preset, layout, way, dtype_name, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed

    from dr_scale.config.schema import ModelConfig
    from dr_scale.launch import leave
    from dr_scale.models import build_model, resolve_shape
    from dr_scale.parallel.pipeline import to_pipeline
    from dr_scale.parallel.sharded_build import build_for_run
    from dr_scale.parallel.tensor import autotp_section, shard_model
    from dr_scale.parallel.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    dtype = getattr(torch, dtype_name)
    shape = resolve_shape(ModelConfig(preset=preset))
    topo = Topology(2, **LAYOUTS[layout]).with_groups()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    torch.manual_seed(1234)
    model = build_model(shape) if way == "whole" else build_for_run(shape, {}, topo)
    if topo.autotp:
        shard_model(model, shape, topo, autotp_section(shape, topo.tensor, True), vocab_parallel=True)
        if way == "meta":
            from dr_scale.parallel.sharded_build import materialize

            materialize(model, None, dtype)
        part = model.to(dtype)  # DeepSpeed's cast (a no-op for the meta build)
    else:
        part = to_pipeline(model, shape, topo, dtype=dtype if way == "meta" else None).to(dtype)
    held = sum(p.numel() for p in part.parameters() if not p.is_meta)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"peak": peak, "before_build": before, "held": held,
                   "seconds": time.perf_counter() - t0}, f)
    torch.distributed.destroy_process_group()
    leave(0)  # see dr_scale.launch.leave


def estimated_startup(preset, layout, precision) -> int:
    from dr_scale.models import resolve_shape
    from dr_scale.config.schema import ModelConfig
    from dr_scale.parallel.estimate import EstimateInputs, estimate
    from dr_scale.parallel.topology import Topology

    inputs = EstimateInputs(Topology(2, **LAYOUTS[layout]), precision=precision, zero_stage=1,
                            micro_batch=1, seq_length=256, vocab_parallel=True)
    return estimate(resolve_shape(ModelConfig(preset=preset)), inputs).startup_peak


def main():
    from dr_scale.runtime.hardware import bf16_support, cpu_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama_1b")
    p.add_argument("--out", default="bench_out/sharded_build")
    a = p.parse_args()
    precision = "bf16" if bf16_support("cpu").native else "fp32"
    dtype_name = "bfloat16" if precision == "bf16" else "float32"
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for layout in LAYOUTS:
            for way in ("whole", "meta"):
                out = Path(work) / f"{layout[:2]}-{way}"
                port = 29500 + (os.getpid() + len(rows)) % 900
                mp.spawn(rank_main, args=(port, a.preset, layout, way, dtype_name, str(out)),
                         nprocs=2)
                ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
                rows.append({"layout": layout, "build": way,
                             "peak_rss_gib": round(max(r["peak"] for r in ranks) / 2**30, 2),
                             "held_params_m": round(max(r["held"] for r in ranks) / 1e6, 1),
                             "seconds": round(max(r["seconds"] for r in ranks), 1)})
                print(rows[-1], flush=True)
        for row in rows:
            whole = next(r for r in rows if r["layout"] == row["layout"] and r["build"] == "whole")
            row["ratio_to_whole"] = round(row["peak_rss_gib"] / whole["peak_rss_gib"], 2)
            if row["build"] == "meta":
                row["estimate_gib"] = round(estimated_startup(a.preset, row["layout"],
                                                              precision) / 2**30, 2)
    where = f"{cpu_model()}, {os.cpu_count()} core(s), {precision}"
    write_results(a.out, rows,
                  f"# Start-up peak RSS per rank, {a.preset} on 2 ranks ({where})",
                  [("layout", "layout"), ("build", "build"), ("peak RSS GiB", "peak_rss_gib"),
                   ("x whole", "ratio_to_whole"), ("estimate GiB", "estimate_gib"),
                   ("parameters held (M)", "held_params_m"), ("build s", "seconds")],
                  {"cpu": cpu_model(), "precision": precision})


if __name__ == "__main__":
    main()
