#!/usr/bin/env python
"""Throughput sweep: presets x DeepSpeed configs x tensor x pipeline layouts x micro-batch x
sequence length x activation checkpointing x attention, each point its own launcher job, eager
and (--compile) with compiled blocks; beside each, the Hugging Face LlamaForCausalLM peer of the
same shape under the same DeepSpeed config and ranks, and the memory estimator's prediction.
With --repeats N every point and its peer run N times, interleaved, and the rows give medians
(the ratio to the peer: a ratio of medians).

    python benchmarks/throughput.py --quick                 # ~10 minutes on a 2-core CPU
    python benchmarks/throughput.py --presets tiny llama_125m --ds_configs zero0 zero1 zero2 zero3
    dr-scale bench --quick                                  # the same, from the console script

Per point: steady-state tokens/s (all ranks), TFLOP/s per rank, MFU and HFU (recomputation
counted), peak memory per rank and the estimate, and the step broken into forward, backward and
optimizer step (communication happens inside the last two). Medians over the log windows after
the first (warm-up). Writes results.jsonl, results.md and throughput.png / memory.png to --out.
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "launchers" / "pretrain.py"


def _port():
    return str(29500 + (os.getpid() * 7 + int.from_bytes(os.urandom(2), "little")) % 2000)


def _env(ranks):
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))


def _run(cmd, ranks, what):
    proc = subprocess.run(cmd, env=_env(ranks), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"benchmark point {what} failed:\n{tail}")
    return proc


def utilisation(train, info) -> dict:
    """The row's MFU and HFU over the one peak the row carries: the run's last (a peak measured
    again during the run replaces the start line's, and every record carries the one it used),
    so mfu = tflops / peak_tflops holds within the row. None where the peak was unreliable."""
    peak = train[-1]["peak_tflops"]
    source = info["peak_flops"]["source"]
    if peak != info["peak_flops"]["value"] / 1e12:
        source += f"; measured again during the run ({peak:.4f} TFLOP/s)"
    reliable = all("mfu" in r for r in train)
    return {**over_one_peak(train, peak, reliable), "peak_tflops": peak, "peak_source": source}


def over_one_peak(figures, peak: float, reliable: bool) -> dict:
    """{mfu, hfu} of the median TFLOP/s (model and hardware) of `figures` (records or rows,
    each with its own peak_tflops) over `peak`; None where a peak was unreliable."""
    if not reliable:
        return {"mfu": None, "hfu": None}
    hardware = statistics.median(f["hfu"] * f["peak_tflops"] for f in figures)
    return {"mfu": statistics.median(f["tflops"] for f in figures) / peak,
            "hfu": hardware / peak}


def run_point(preset, ds_config, ranks, steps, seq, micro, extra, workdir, log_interval=5):
    """One dr_scale training job; the medians of its training records after the first window."""
    # A fresh folder per point: a sweep may repeat a point (A/B runs) and a config may be a path.
    run_dir = Path(tempfile.mkdtemp(prefix=f"{preset}-{Path(ds_config).stem}-{ranks}r-",
                                    dir=workdir))
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", _port(), str(PRETRAIN),
           "--ds_config", ds_config, "--run_dir", str(run_dir), f"model.preset={preset}",
           f"train.max_steps={steps}", f"train.micro_batch_size={micro}",
           f"data.seq_length={seq}", f"train.log_interval={log_interval}",
           f"train.eval_interval={steps}", "train.eval_samples=8",
           f"train.save_interval={steps + 1}", "train.warmup_steps=5", "logging.plot=false",
           "logging.tensorboard=false", "logging.step_breakdown=true", *extra]
    _run(cmd, ranks, f"{preset}/{ds_config}")
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "tokens_per_s" in r][1:]  # drop the warm-up window
    if not train:
        raise SystemExit(f"{run_dir}: too few steps to measure; raise --steps")
    med = lambda k: statistics.median(r[k] for r in train)  # noqa: E731
    info = json.loads((run_dir / "run.json").read_text())
    row = {"preset": preset, "ds_config": ds_config, "ranks": ranks, "seq_length": seq,
           "micro_batch_size": micro, "tokens_per_s": med("tokens_per_s"),
           "tflops": med("tflops"), **utilisation(train, info),
           "mem_peak_bytes": max(r["mem_peak_bytes"] for r in train),
           "step_time_s": med("step_time_s"),
           "vocab_size": info["model"]["shape"]["vocab_size"],
           "parameters": info["model"]["parameters"],
           "last_loss": [r for r in recs if "tokens_per_s" in r][-1]["loss"]}
    for phase in ("forward", "backward", "optimizer_step"):
        if f"time_{phase}_s" in train[0]:
            row[f"time_{phase}_s"] = med(f"time_{phase}_s")
    return row


def run_peer(preset, ds_config, ranks, steps, seq, micro, vocab, workdir):
    out = Path(tempfile.mkdtemp(prefix=f"peer-{preset}-{Path(ds_config).stem}-", dir=workdir)) \
        / "peer.json"
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", _port(),
           str(ROOT / "benchmarks" / "hf_peer.py"), "--preset", preset, "--ds_config", ds_config,
           "--seq_length", str(seq), "--micro_batch_size", str(micro), "--steps", str(steps),
           "--warmup", str(max(2, steps // 4)), "--vocab_size", str(vocab), "--out", str(out)]
    _run(cmd, ranks, f"peer {preset}/{ds_config}")
    return json.loads(out.read_text())


def estimate_bytes(preset, ds_config, ranks, seq, micro, extra, vocab, device, key="total"):
    """`dr-scale estimate`'s figure `key` (total: steady state; peak: start-up included)."""
    cmd = [sys.executable, "-m", "dr_scale.cli", "estimate", "--ds_config", ds_config, "--ranks",
           str(ranks), "--device", device, "--json", f"model.preset={preset}",
           f"data.seq_length={seq}", f"train.micro_batch_size={micro}",
           f"model.vocab_size={vocab}", *[e for e in extra if not e.startswith("logging.")]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)["bytes_per_rank"][key]


def _paired_bars(path, labels, left, right, names, ylabel, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    ax.bar([i - 0.2 for i in x], left, 0.4, label=names[0])
    ax.bar([i + 0.2 for i in x], right, 0.4, label=names[1])
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows, out: Path):
    labels = [r["label"] for r in rows]
    _paired_bars(out / "throughput.png", labels, [r["tokens_per_s"] for r in rows],
                 [r.get("peer_tokens_per_s") or 0 for r in rows],
                 ("dr_scale", "HF Llama + DeepSpeed"), "tokens/s (all ranks)", "throughput")
    _paired_bars(out / "memory.png", labels, [r["mem_peak_bytes"] / 2**20 for r in rows],
                 [(r.get("mem_estimate_bytes") or 0) / 2**20 for r in rows],
                 ("measured peak", "dr-scale estimate"), "MiB per rank", "memory per rank")


def table(rows) -> str:
    head = ("| point | tokens/s | peer tokens/s | vs peer | TFLOP/s/rank | MFU | HFU | "
            "fwd / bwd / step ms | peak MiB/rank | estimate MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peer = r.get("peer_tokens_per_s")
        parts = [r.get(f"time_{p}_s") for p in ("forward", "backward", "optimizer_step")]
        split = " / ".join(f"{1e3 * v:.0f}" for v in parts) if all(parts) else "-"
        est = r.get("mem_estimate_bytes")
        peer_s = f"{peer:,.0f}" if peer else "-"
        ratio = f"{r['tokens_per_s'] / peer:.2f}x" if peer else "-"
        est_s = f"{est / 2**20:,.0f}" if est else "-"
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:,.0f} | {peer_s} | {ratio} | "
            f"{r['tflops']:.4f} | {percent(r['mfu'])} | {percent(r['hfu'])} | {split} | "
            f"{r['mem_peak_bytes'] / 2**20:,.0f} | {est_s} |")
    return "\n".join(lines)


def percent(share) -> str:
    return "n/a (peak unreliable)" if share is None else f"{100 * share:.1f}%"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny"])
    p.add_argument("--ds_configs", nargs="+", default=["zero0", "zero1", "zero2", "zero3"])
    p.add_argument("--tensor_parallel", nargs="+", type=int, default=[1])
    p.add_argument("--pipeline_parallel", nargs="+", type=int, default=[1],
                   help="stages (ZeRO-0/1; give train.global_batch_size=... so a step has "
                        "several micro-batches)")
    p.add_argument("--micro_batch_sizes", nargs="+", type=int, default=[8])
    p.add_argument("--seq_lengths", nargs="+", type=int, default=[256])
    p.add_argument("--checkpointing", nargs="+", default=["none"],
                   choices=["none", "full", "selective"])
    p.add_argument("--attention", nargs="+", default=["sdpa"])
    p.add_argument("--compile", nargs="+", default=["false"], choices=["false", "true", "auto"],
                   help="model.compile per point, each a row of its own (eager only with "
                        "activation checkpointing, where compiling is refused)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each point and of its peer, interleaved; the rows give medians "
                        "over them and the ratio of medians")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no_peer", action="store_true", help="skip the Hugging Face peer")
    p.add_argument("--quick", action="store_true",
                   help="tiny preset, zero1, zero2 and zero3, eager and compiled, 15 steps, "
                        "2 repeats: about ten minutes on 2 CPU cores")
    p.add_argument("--out", default="bench_out/throughput")
    p.add_argument("overrides", nargs="*", help="extra dotted.key=value for every point")
    a = p.parse_args(argv)
    if a.quick:
        a.presets, a.ds_configs, a.steps = ["tiny"], ["zero1", "zero2", "zero3"], 15
        a.compile, a.repeats = ["false", "true"], 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if _has_cuda() else "cpu"
    grid = list(itertools.product(a.presets, a.ds_configs, a.tensor_parallel, a.pipeline_parallel,
                                  a.micro_batch_sizes, a.seq_lengths, a.checkpointing,
                                  a.attention))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (preset, ds, tp, pp, micro, seq, ckpt, attn) in enumerate(grid, 1):
            extra = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}",
                     f"parallel.activation_checkpointing={ckpt}", f"model.attention={attn}",
                     *a.overrides]
            layout = f"DP{a.ranks // (tp * pp)}xTP{tp}" + (f"xPP{pp}" if pp > 1 else "")
            label = f"{preset} {ds} {layout} m{micro} s{seq}" + \
                (f" ckpt={ckpt}" if ckpt != "none" else "") + (f" {attn}" if attn != "sdpa" else "") + \
                "".join(f" {o}" for o in a.overrides)
            # compiling is refused with activation checkpointing
            modes = [m for m in a.compile if m == "false" or ckpt == "none"]
            with_peer = not a.no_peer and tp == pp == 1 and ckpt == "none" and attn == "sdpa"
            runs, peers = {m: [] for m in modes}, []
            for repeat in range(a.repeats):  # interleaved: ours and the peer's, repeat by repeat
                for mode in modes:
                    print(f"[{i}/{len(grid)}] {label} compile={mode} (run {repeat + 1}) ...",
                          file=sys.stderr, flush=True)
                    runs[mode].append(run_point(preset, ds, a.ranks, a.steps, seq, micro,
                                                [*extra, f"model.compile={mode}"], work))
                if with_peer:
                    print(f"[{i}/{len(grid)}] peer: HF LlamaForCausalLM, same shape and config "
                          f"(run {repeat + 1}) ...", file=sys.stderr, flush=True)
                    peers.append(run_peer(preset, ds, a.ranks, a.steps, seq, micro,
                                          runs[modes[0]][-1]["vocab_size"], work))
            for mode in modes:
                row = medians(runs[mode])
                row.update(label=label + ("" if mode == "false" else f" compile={mode}"),
                           layout=layout, tensor_parallel=tp, pipeline_parallel=pp,
                           activation_checkpointing=ckpt, attention=attn, compile=mode,
                           repeats=len(runs[mode]))
                row["mem_estimate_bytes"] = estimate_bytes(preset, ds, a.ranks, seq, micro, extra,
                                                           row["vocab_size"], device)
                if peers:
                    row["peer_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in peers)
                    row["peer_mem_peak_bytes"] = max(r["mem_peak_bytes"] for r in peers)
                    row["vs_peer"] = row["tokens_per_s"] / row["peer_tokens_per_s"]
                else:
                    row["peer_tokens_per_s"] = None
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    md = table(rows)
    peaks = sorted({f"{r['peak_tflops']:.4f} TFLOP/s per rank, {r['peak_source']}" for r in rows})
    (out / "results.md").write_text(f"{md}\n\nMFU/HFU denominator: {'; '.join(peaks)}\n")
    plot(rows, out)
    print(f"\n{md}\n\nwrote {out / 'results.jsonl'}, results.md, throughput.png, memory.png")


def medians(runs: list) -> dict:
    """One row from repeated runs of a point: the median of each figure (the peak: the
    largest)."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float) and key not in ("peak_tflops", "mfu", "hfu"):
            row[key] = statistics.median(r[key] for r in runs)
    row["mem_peak_bytes"] = max(r["mem_peak_bytes"] for r in runs)
    best = max(runs, key=lambda r: r["peak_tflops"])
    row["peak_tflops"], row["peak_source"] = best["peak_tflops"], best["peak_source"]
    # over the row's one peak, as in each run
    row.update(over_one_peak(runs, row["peak_tflops"], all(r["mfu"] is not None for r in runs)))
    return row


def _has_cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
