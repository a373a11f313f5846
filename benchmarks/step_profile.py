#!/usr/bin/env python
"""Where a training step's time goes, ours beside the Hugging Face peer's, by kind of operator.

    python benchmarks/step_profile.py [--preset tiny] [--ds_configs zero1 zero3] [--compile]
                                      [--ranks 2] [--out bench_out/step_profile]

Each point is one run of ours (the step_profiler callback over 2 steps after the warm-up) and
one of the peer (benchmarks/hf_peer.py --profile_out, 2 steps after its timed ones), same shape,
DeepSpeed config and ranks; rank 0's operators' self times (torch.profiler) are summed per step
into: GEMMs (mm, addmm, bmm), attention (SDPA), communication (gloo/NCCL collectives),
optimizer (AdamW kernels), and the rest (norms, rotary, SwiGLU, the loss, copies, casts: where
a faster step must come from when GEMMs are the same). The profiler's own cost falls on the many
small operators, so the rest reads high for both; compare the two columns, not the sum with
tokens/s. The rest's costliest operators of each side are printed and kept in the total row
of results.jsonl. Writes results.jsonl and results.md (the CPU named) to --out.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench_results import write_results
from throughput import PRETRAIN, ROOT, _port, _run

KINDS = ("GEMM", "attention", "communication", "optimizer", "rest")


def kind_of(name: str) -> str:
    n = name.lower()
    if n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_addmm_activation") or \
            "extern_kernels.mm" in n:
        return "GEMM"
    if "scaled_dot_product" in n or "flash_attention" in n or "_efficient_attention" in n:
        return "attention"
    if n.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")) or any(
            c in n for c in ("all_reduce", "allreduce", "all_gather", "allgather",
                             "reduce_scatter", "broadcast", "all_to_all")):
        return "communication"
    if "adam" in n:
        return "optimizer"
    return "rest"


def is_range(name: str) -> bool:
    """The trainer's own named ranges (dr_scale.forward, ...): their self time is the Python
    between operators, which the peer, having no ranges, does not show: left out of both."""
    return name.startswith(("dr_scale.", "ProfilerStep"))


def by_kind(ops_json: Path) -> dict:
    data = json.loads(ops_json.read_text())
    totals = dict.fromkeys(KINDS, 0.0)
    for name, op in data["operators"].items():
        if not is_range(name):
            totals[kind_of(name)] += op["self_ms"]
    return totals


def top_rest(ops_json: Path, n: int = 8) -> list:
    """The `n` costliest operators of the rest: (name, ms a step, calls a step)."""
    ops = json.loads(ops_json.read_text())["operators"]
    rest = [(name, op["self_ms"], op["calls"]) for name, op in ops.items()
            if kind_of(name) == "rest" and not is_range(name)]
    return sorted(rest, key=lambda r: -r[1])[:n]


def ours(preset, ds, ranks, seq, micro, compiled, work) -> dict:
    run = Path(tempfile.mkdtemp(prefix=f"ours-{ds}-", dir=work)) / "run"
    steps = 8
    _run(["deepspeed", "--num_gpus", str(ranks), "--master_port", _port(), str(PRETRAIN),
          "--ds_config", ds, "--run_dir", str(run), f"model.preset={preset}",
          f"train.max_steps={steps}", f"train.micro_batch_size={micro}", f"data.seq_length={seq}",
          "train.log_interval=4", f"train.eval_interval={steps}", "train.eval_samples=8",
          f"train.save_interval={steps + 1}", "logging.plot=false", "logging.tensorboard=false",
          f"model.compile={'true' if compiled else 'false'}",
          "callbacks={step_profiler: {enabled: true, start_step: 5, steps: 2}}"], ranks,
         f"ours {preset}/{ds}")
    info = json.loads((run / "run.json").read_text())
    ops = next((run / "profiles").glob("*.ops.json"))
    return {"kinds": by_kind(ops), "rest": top_rest(ops),
            "vocab_size": info["model"]["shape"]["vocab_size"]}


def peer(preset, ds, ranks, seq, micro, vocab, work) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"peer-{ds}-", dir=work))
    _run(["deepspeed", "--num_gpus", str(ranks), "--master_port", _port(),
          str(ROOT / "benchmarks" / "hf_peer.py"), "--preset", preset, "--ds_config", ds,
          "--seq_length", str(seq), "--micro_batch_size", str(micro), "--steps", "6",
          "--warmup", "3", "--vocab_size", str(vocab), "--out", str(out / "peer.json"),
          "--profile_out", str(out / "peer.ops.json")], ranks, f"peer {preset}/{ds}")
    return {"kinds": by_kind(out / "peer.ops.json"), "rest": top_rest(out / "peer.ops.json")}


def main(argv=None):
    from dr_scale.runtime.hardware import cpu_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ds_configs", nargs="+", default=["zero1", "zero3"])
    p.add_argument("--compile", action="store_true", help="ours with compiled blocks")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--out", default="bench_out/step_profile")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ds in a.ds_configs:
            print(f"{a.preset} {ds}: ours ...", file=sys.stderr, flush=True)
            mine = ours(a.preset, ds, a.ranks, a.seq_length, a.micro_batch_size, a.compile, work)
            print(f"{a.preset} {ds}: peer ...", file=sys.stderr, flush=True)
            theirs = peer(a.preset, ds, a.ranks, a.seq_length, a.micro_batch_size,
                          mine["vocab_size"], work)
            for kind in KINDS + ("total",):
                m = sum(mine["kinds"].values()) if kind == "total" else mine["kinds"][kind]
                t = sum(theirs["kinds"].values()) if kind == "total" else theirs["kinds"][kind]
                rows.append({"preset": a.preset, "ds_config": ds, "compiled": a.compile,
                             "kind": kind, "ours_ms": m, "peer_ms": t})
                print(f"{ds} {kind:13s} ours {m:8.1f} ms  peer {t:8.1f} ms", flush=True)
            rows[-1].update(ours_top_rest=mine["rest"], peer_top_rest=theirs["rest"])
            for who, top in (("ours", mine["rest"]), ("peer", theirs["rest"])):
                print(f"{ds} {who}'s costliest of the rest: " + ", ".join(
                    f"{name} {ms:.1f} ms ({calls:.0f} calls)" for name, ms, calls in top),
                    flush=True)
    write_results(a.out, rows,
                  f"Self time per step on rank 0 by operator kind, {a.preset}, {a.ranks} ranks, "
                  f"{a.micro_batch_size} x {a.seq_length} tokens a rank, ours "
                  f"{'compiled' if a.compile else 'eager'} ({cpu_model()}, {os.cpu_count()} "
                  f"cores; torch.profiler)",
                  [("ZeRO config", "ds_config"), ("kind", "kind"),
                   ("ours ms", lambda r: f"{r['ours_ms']:.1f}"),
                   ("peer ms", lambda r: f"{r['peer_ms']:.1f}"),
                   ("ours / peer", lambda r: f"{r['ours_ms'] / r['peer_ms']:.2f}"
                    if r["peer_ms"] else "-")],
                  facts={"cpu": cpu_model(), "cores": os.cpu_count()})


if __name__ == "__main__":
    main()
