#!/usr/bin/env python
"""Memory that falls with ranks, start-up included: llama_1b (the full preset shape) under ZeRO-3
trains 3 steps on N ranks of this machine for each N, side by side in one run; each rank's peak
RSS from process start to the end of step 3 (the largest over the ranks) against
`dr-scale estimate`'s per-rank figure for the same run. With several --ds_config (zero3
zero3_nvme: ZeRO-Infinity's optimizer state on NVMe), each runs at each rank count, and the
losses of each config are compared with the first's at the same rank count.

    python benchmarks/memory_scaling.py [--preset llama_1b] [--ranks 2 4] [--seq_length 256]
                                        [--ds_config zero3 [zero3_nvme]] [--num_layers L]

Precision: the bundled zero3 config's bf16 "auto" (bf16 where the CPU computes it natively,
fp32 otherwise); the line printed says which. Writes results.jsonl and results.md; the CPU model
heads both.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_results import write_results

ROOT = Path(__file__).resolve().parent.parent


def run_args(preset, seq, ranks, vocab, layers=None, overrides=()):
    return [f"model.preset={preset}", f"model.vocab_size={vocab}", f"data.seq_length={seq}",
            *([f"model.num_layers={layers}"] if layers else []), *overrides,
            "train.micro_batch_size=1",
            f"train.global_batch_size={ranks}", "train.max_steps=3", "train.warmup_steps=1",
            "train.eval_at_start=false", "train.eval_interval=1000", "train.save_interval=1000",
            "train.log_interval=1", "logging.plot=false", "logging.tensorboard=false"]


def measured(ds_config, preset, seq, ranks, vocab, layers, work, overrides=()):
    run = Path(tempfile.mkdtemp(prefix=f"{Path(ds_config).stem}-{ranks}ranks-", dir=work)) / "run"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 900),
           str(ROOT / "launchers" / "pretrain.py"), "--ds_config", ds_config, "--run_dir", str(run),
           *run_args(preset, seq, ranks, vocab, layers, overrides)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    refusal = [line for line in proc.stderr.splitlines() if "--skip_memory_check" in line]
    if proc.returncode == 2 and refusal:  # the launcher's memory check: a result, not a failure
        return {"ds_config": ds_config, "ranks": ranks, "refused": refusal[-1],
                "wall_s": round(time.perf_counter() - t0, 1)}
    if proc.returncode:
        raise SystemExit(f"{ds_config}, {ranks} ranks: the run failed ({proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step3 = next(r for r in records if r.get("step") == 3 and "loss" in r)
    precision = re.search(r"ZeRO-3, (\w+)", proc.stdout).group(1)
    params = re.search(r"\) ([\d.]+[MB]) parameters;", proc.stdout).group(1)
    return {"ds_config": ds_config, "ranks": ranks, "peak_rss_gib": step3["mem_peak_bytes"] / 2**30,
            "wall_s": round(time.perf_counter() - t0, 1), "precision": precision,
            # after the first step (its optimizer state is made then)
            "step_s": round(statistics.mean(r["step_time_s"] for r in records
                                            if r.get("step", 0) > 1 and "loss" in r), 2),
            "parameters": params, "losses": [r["loss"] for r in records if "loss" in r],
            "run_dir": str(run)}


def estimated(ds_config, preset, seq, ranks, vocab, layers, overrides=()) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "estimate", "--ds_config",
                           ds_config, "--ranks", str(ranks), "--device", "cpu", "--json",
                           *run_args(preset, seq, ranks, vocab, layers, overrides)],
                          capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def config_variant(ds_config, name: str, work, **zero) -> str:
    """A copy of `ds_config` with `zero` set in its zero_optimization, written to `work` under
    `name` (a path to it)."""
    from dr_scale.config import ds_config as dsc

    ds = dsc.read_json(dsc.resolve_path(ds_config))
    ds["zero_optimization"].update(zero)
    path = Path(work) / f"{Path(ds_config).stem}_{name}.json"
    path.write_text(json.dumps(ds, indent=2))
    return str(path)


def fewer_live(ds_config, live: float, work) -> str:
    """A copy of `ds_config` keeping at most `live` gathered parameters (a path to it)."""
    return config_variant(ds_config, f"live{live:g}", work, stage3_max_live_parameters=live,
                          stage3_max_reuse_distance=live)


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq_length", type=int, default=256)
    ap.add_argument("--vocab_size", type=int, default=4096,
                    help="the bundled tokenizer's (the preset's 128,256 would not fit 2 ranks "
                         "in 24 GiB: 1.24B parameters x 16 bytes of state)")
    ap.add_argument("--num_layers", type=int, default=None,
                    help="cut the preset's depth (llama_1b's 16 layers, 0.98B parameters at "
                         "16 bytes of state each: 10.4 GiB a rank at 2 ranks with the bundled "
                         "zero3, 5.2 at 4 with --max_live_parameters 1e8, measured on a 23 GiB "
                         "machine; with sub_group_size 1e9, 2 ranks were killed for memory)")
    ap.add_argument("--ds_config", nargs="+", default=["zero3"],
                    help="DeepSpeed configs side by side (e.g. zero3 zero3_nvme)")
    ap.add_argument("--max_live_parameters", type=float, default=None,
                    help="also run each config with ZeRO-3's stage3_max_live_parameters and "
                         "stage3_max_reuse_distance at this value (DeepSpeed's default 1e9 keeps "
                         "a model below 1e9 parameters gathered whole on every rank)")
    ap.add_argument("--overrides", nargs="*", default=[],
                    help="more key=value for every run and estimate (e.g. "
                         "parallel.tensor_parallel=2)")
    ap.add_argument("--also", nargs="*", default=[],
                    help="also run each config with these key=value added, side by side (e.g. "
                         "train.release_host_memory=true)")
    ap.add_argument("--out", default="bench_out/memory_scaling")
    a = ap.parse_args(argv)
    where = f"{cpu_model()}, {os.cpu_count()} core(s)"
    depth = f", {a.num_layers} layers" if a.num_layers else ""
    print(f"memory scaling: {a.preset}{depth}, {' and '.join(a.ds_config)} on {a.ranks} rank(s)"
          f"{' '.join([','] + a.overrides) if a.overrides else ''}, on {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-bench-", dir=os.environ.get("TMPDIR")) as work:
        configs = [(d, d, ()) for d in a.ds_config]
        if a.max_live_parameters:
            configs += [(f"{d}, live {a.max_live_parameters:g}",
                         fewer_live(d, a.max_live_parameters, work), ()) for d in a.ds_config]
        if a.also:
            configs += [(f"{label}, {' '.join(a.also)}", d, tuple(a.also))
                        for label, d, _ in list(configs)]
        for (label, ds_config, extra), ranks in [(c, n) for c in configs for n in a.ranks]:
            overrides = (*a.overrides, *extra)
            row = measured(ds_config, a.preset, a.seq_length, ranks, a.vocab_size, a.num_layers,
                           work, overrides)
            row["ds_config"] = label
            est = estimated(ds_config, a.preset, a.seq_length, ranks, a.vocab_size, a.num_layers,
                            overrides)
            per_rank = est["bytes_per_rank"]
            row["estimate_gib"] = per_rank.get("peak", per_rank["total"]) / 2**30
            row["startup_estimate_gib"] = per_rank.get("startup_peak", 0) / 2**30
            if "refused" in row:
                print(f"  {label}, {ranks} rank(s): refused before building: "
                      f"{row['refused'].split('error: ', 1)[-1]}", flush=True)
                rows.append(row)
                continue
            row["measured_over_estimate"] = row["peak_rss_gib"] / row["estimate_gib"]
            print(f"  {label}, {ranks} rank(s), {row['parameters']} parameters, "
                  f"{row['precision']}: peak RSS per rank {row['peak_rss_gib']:.2f} GiB (start-up "
                  f"included), estimate {row['estimate_gib']:.2f} GiB "
                  f"({row['measured_over_estimate']:.2f}x); steps 2-3 {row['step_s']:.1f} s "
                  f"each, wall {row['wall_s']:.0f} s",
                  flush=True)
            rows.append(row)
    ran = [r for r in rows if "refused" not in r]
    first = {}
    for r in ran:
        base = first.setdefault(r["ds_config"], r)  # the config's first rank count
        if r is not base:
            print(f"{r['ds_config']}: {r['ranks']} ranks / {base['ranks']} ranks: peak RSS per "
                  f"rank {r['peak_rss_gib'] / base['peak_rss_gib']:.2f}x")
        ref = next(q for q in ran if q["ranks"] == r["ranks"])  # the first config's run
        if ref is not r:
            r["vs_first_config"] = round(r["peak_rss_gib"] / ref["peak_rss_gib"], 3)
            r["max_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
            print(f"{r['ranks']} ranks: {r['ds_config']} / {ref['ds_config']}: peak RSS per rank "
                  f"{r['vs_first_config']:.2f}x; losses {r['losses']} vs {ref['losses']} (largest "
                  f"difference {r['max_loss_diff']:.2e})")
    for r in rows:
        for k in ("peak_rss_gib", "estimate_gib", "startup_estimate_gib",
                  "measured_over_estimate"):
            if k in r:
                r[k] = round(r[k], 3)
    write_results(a.out, rows, f"# Peak RSS per rank, {a.preset}{depth} ZeRO-3 ({where})",
                  [("DeepSpeed config", "ds_config"), ("ranks", "ranks"),
                   ("precision", "precision"),
                   ("peak RSS per rank (GiB)",
                    lambda r: "refused before building" if "refused" in r else r["peak_rss_gib"]),
                   ("estimate (GiB)", "estimate_gib"),
                   ("measured / estimate", "measured_over_estimate"),
                   ("step 2-3 (s)", "step_s"), ("wall (s)", "wall_s")],
                  dict(cpu=where))


if __name__ == "__main__":
    main()
