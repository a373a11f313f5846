"""Bad input at the command line: one line naming the file/key, exit status 2, no traceback,
nothing already written damaged."""
import dataclasses
import hashlib
import json
import re
import subprocess
import sys

import pytest

from dr_scale.parallel.topology import Topology
from tests.conftest import ROOT, launch


def errors_of(proc):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("args, pattern", [
    (["--ds_config", "zero9.json"], "--ds_config zero9.json: file not found"),
    ([], "command line: the following arguments are required: --ds_config"),
    (["--ds_config", "zero3", "train.lr=fast"], "command line: train.lr: expected a number, got 'fast'"),
    (["--ds_config", "zero3", "--config", "nowhere.yaml"], "nowhere.yaml: config file not found"),
    (["--ds_config", "zero3", "--resume"], "--resume: needs --run_dir"),
    (["--ds_config", "zero3", "train.micro_batch_size=3", "train.global_batch_size=8"],
     "train.global_batch_size=8 is not a multiple of train.micro_batch_size=3 x data-parallel size 1 = 3"),
    (["--ds_config", "zero3", "data.tokenizer=/nope/tok.model", "data.datasets=[{prefix: /nope/d}]"],
     "/nope/tok.model: tokenizer not found"),
    (["--ds_config", "zero3", "data.seq_length=4096"],
     "data.seq_length=4096 exceeds model.max_seq_length=1024"),
])
def test_pretrain_bad_input(args, pattern, cache_dir, tmp_path):
    run_dir = [] if "--resume" in args else ["--run_dir", tmp_path / "run"]
    proc = launch([*run_dir, *args], 1, cache_dir, launcher="python", check=False, timeout=300)
    assert pattern in errors_of(proc)


def test_a_run_that_cannot_fit_is_refused_before_building(cache_dir, tmp_path):
    """The estimate against what a rank has, before any allocation: llama_70b under ZeRO-1 needs
    1.3 TiB a rank in bf16 (16-bit weights and gradients beside fp32 master weights and moments)
    or 1.6 TiB in fp32 (a CPU without native bf16: 32-bit weights and gradients, DeepSpeed's
    master clone and flattened gradient, Adam's moments), and nothing fits one rank
    here; llama_7b in bf16 (asked for explicitly, so the answer is the same on every CPU kind)
    is told the cheapest change: more nodes like this one under ZeRO-3 (on a CPU more ranks on
    this node would share its memory; how many nodes depends on its free memory). Nothing is
    written."""
    from dr_scale.runtime.hardware import cpu_bf16_support

    proc = launch(["--run_dir", tmp_path / "a", "--ds_config", "zero1", "model.preset=llama_70b"],
                  1, cache_dir, launcher="python", check=False, timeout=120)
    line = errors_of(proc)
    peak = r"1\.3" if cpu_bf16_support().native else r"1\.6"
    assert re.search(r"zero1.json: estimated peak " + peak + r" TiB a rank \(`dr-scale estimate`, "
                     r"x1\.6 for the freed pages glibc keeps without train\.release_host_memory\) "
                     r"exceeds [\d.]+ GiB a rank \([\d.]+ GiB of host memory available, shared by "
                     r"1 rank\(s\) on this node\); none of ZeRO-3, checkpointing, offload or 64x "
                     r"the nodes fits; --skip_memory_check starts anyway", line), line
    bf16 = tmp_path / "zero1_bf16.json"
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    bf16.write_text(json.dumps({**ds, "bf16": {"enabled": True}}))
    proc = launch(["--run_dir", tmp_path / "b", "--ds_config", bf16, "model.preset=llama_7b",
                   "data.seq_length=1024", "train.micro_batch_size=1"], 1, cache_dir,
                  launcher="python", check=False, timeout=120)
    assert re.search(r"cheapest change that fits: (\d+)x the nodes \((\d+) ranks, as many a node "
                     r"as now\) with ZeRO-3 \([\d.]+ GiB a rank\)", errors_of(proc))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_existing_run_is_not_overwritten(cache_dir, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = hashlib.sha256((run / "metrics.jsonl").read_bytes()).hexdigest()
    proc = launch(["--ds_config", "zero3", "--run_dir", run], 1, cache_dir, launcher="python",
                  check=False, timeout=300)
    assert "already holds checkpoints; pass --resume" in errors_of(proc)
    assert hashlib.sha256((run / "metrics.jsonl").read_bytes()).hexdigest() == before


def test_resume_without_checkpoint(cache_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = launch(["--ds_config", "zero3", "--run_dir", run, "--resume"], 1, cache_dir,
                  launcher="python", check=False, timeout=300)
    assert "config.yaml: not found; --resume continues a run folder" in errors_of(proc)


def dr_scale_cli(*args):
    return subprocess.run([sys.executable, "-m", "dr_scale.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_console_script_errors(tmp_path):
    assert "/nope.model: tokenizer not found" in errors_of(
        dr_scale_cli("preprocess", "--input", "x.jsonl", "--tokenizer", "/nope.model", "--out", tmp_path / "o"))
    assert "command line: the following arguments are required: --out" in errors_of(
        dr_scale_cli("tokenizer", "--input", "x.txt"))
    assert "missing.txt: input file not found" in errors_of(
        dr_scale_cli("tokenizer", "--input", tmp_path / "missing.txt", "--out", tmp_path / "t"))
    assert "--to 'dp=2 tp=x': expected sizes like \"dp=2 tp=1 pp=2 ep=1\"" in errors_of(
        dr_scale_cli("reshard", "--run_dir", tmp_path, "--to", "dp=2 tp=x"))
    assert "reshard: give --ranks N" in errors_of(dr_scale_cli("reshard", "--run_dir", tmp_path))
    assert f"{tmp_path / 'checkpoints'}: no checkpoints" in errors_of(
        dr_scale_cli("verify", "--run_dir", tmp_path))


def test_console_script_tokenizer_then_preprocess(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = dr_scale_cli("tokenizer", "--input", src, "--out", tmp_path / "tok", "--vocab_size", 300)
    assert out.returncode == 0, out.stderr
    out = dr_scale_cli("preprocess", "--input", src, "--tokenizer", tmp_path / "tok.model",
                       "--out", tmp_path / "corpus")
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "1 documents" in out.stdout
    from dr_scale.data.indexed import IndexedDataset
    from dr_scale.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tmp_path / "tok.model")
    ds = IndexedDataset(tmp_path / "corpus")
    assert tok.decode(ds.document(0)[:-1]) == src.read_text()


def test_deepspeed_rejections_become_one_line(cache_dir, tmp_path):
    import torch

    # DeepSpeed's CPU accelerator takes fp16 where oneDNN computes it (AVX512-FP16 / AMX-FP16
    # CPUs): there the config trains, elsewhere it is refused in one line.
    proc = launch(["--ds_config", "zero2_fp16", "--run_dir", tmp_path / "a",
                   "train.max_steps=2", "train.eval_at_start=false"], 1, cache_dir,
                  launcher="python", check=False, timeout=300)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert proc.returncode == 0 and "ZeRO-2, fp16" in proc.stdout, proc.stderr[-2000:]
    else:
        assert "zero2_fp16.json: fp16.enabled: fp16 is not supported on the cpu accelerator" \
            in errors_of(proc)
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "bogus_key": 1}, '
                   '"optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": true}}}')
    proc = launch(["--ds_config", bad, "--run_dir", tmp_path / "b"], 1, cache_dir,
                  launcher="python", check=False, timeout=300)
    assert "bad.json: zero_optimization.bogus_key: Extra inputs are not permitted" in errors_of(proc)


def test_whole_config_is_checked_before_the_process_group(cache_dir, tmp_path):
    """An unknown preset, an impossible layout or a bad callback option stop the launcher before
    the distributed set-up (whose first step builds DeepSpeed's comm op)."""
    for args, message in [
        (["model.preset=llama_9b"], "model.preset: unknown preset 'llama_9b'; known: "),
        (["parallel.tensor_parallel=3"], "tensor_parallel=3 x pipeline_parallel=1 does not "
                                         "divide the world of 1 ranks"),
        (["callbacks={ema: {enabled: true, decay: 2}}"], "callbacks.ema.decay: expected a number "
                                                         "in [0, 1), got 2"),
    ]:
        proc = launch(["--ds_config", "zero3", "--run_dir", tmp_path / "r", *args], 1, cache_dir,
                      launcher="python", check=False, timeout=300)
        assert message in errors_of(proc)
        assert "deepspeed_shm_comm_op" not in proc.stdout + proc.stderr
        assert not (tmp_path / "r").exists()


def test_deepspeed_config_without_optimizer_trains_with_torch_adamw(cache_dir, tmp_path):
    """Users' own JSON often has no optimizer section: torch AdamW is built from train.* (as
    Hugging Face's Trainer does) and said so; it trains exactly as the same AdamW named in the
    JSON (fp32, 1 rank, 4 steps, losses equal to 1e-6)."""
    import json

    args = ["data.seq_length=64", "train.max_steps=4", "train.log_interval=1",
            "train.eval_samples=8", "logging.plot=false", "logging.tensorboard=false"]
    base = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": False}, "zero_optimization": {"stage": 1}}
    named = dict(base, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8,
        "torch_adam": True}})
    losses = {}
    for name, ds in (("none", base), ("named", named)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(ds))
        proc = launch(["--ds_config", path, "--run_dir", tmp_path / name, *args], 1, cache_dir,
                      launcher="python")
        records = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
        if name == "none":
            assert ("optimizer torch AdamW from train.* (lr 0.003, weight decay 0.1, betas "
                    "0.9/0.999; the DeepSpeed config has no optimizer section)") in proc.stdout
    assert len(losses["none"]) == 4
    assert losses["none"] == pytest.approx(losses["named"], rel=1e-6)


def test_resume_forms_on_the_command_line():
    from dr_scale.errors import DrScaleError
    from dr_scale.config.arguments import parse_args

    a = parse_args(["--ds_config", "zero3", "--resume", "model.num_layers=2"])
    assert a.resume == "latest" and a.overrides == ["model.num_layers=2"]  # not swallowed
    assert parse_args(["--ds_config", "zero3", "--resume", "auto", "x.y=1"]).resume == "auto"
    assert parse_args(["--ds_config", "zero3", "--resume=auto"]).resume == "auto"
    assert parse_args(["--ds_config", "zero3"]).resume is None
    with pytest.raises(DrScaleError, match=r"^command line: --resume=sometimes: expected auto or "
                                           r"latest$"):
        parse_args(["--ds_config", "zero3", "--resume=sometimes"])


def test_overrides_may_sit_between_the_options():
    """`--ds_config zero3 model.preset=tiny --run_dir D train.max_steps=5`, for the launcher and
    the console script alike; what is neither an option nor key=value is still one line."""
    from dr_scale.cli import build_parser, parse
    from dr_scale.errors import DrScaleError
    from dr_scale.config.arguments import parse_args

    a = parse_args(["--ds_config", "zero3", "model.preset=tiny", "--run_dir", "d", "x.y=1",
                    "--resume", "auto", "z=2"])
    assert (a.ds_config, a.run_dir, a.resume, a.overrides) == \
        ("zero3", "d", "auto", ["model.preset=tiny", "x.y=1", "z=2"])
    e = parse(build_parser(), ["estimate", "--ds_config", "zero3", "model.preset=tiny",
                               "--ranks", "8", "train.micro_batch_size=1", "--json"])
    assert (e.ranks, e.json, e.overrides) == (8, True, ["model.preset=tiny",
                                                        "train.micro_batch_size=1"])
    with pytest.raises(DrScaleError, match=r"^command line: unrecognized arguments: --bogus "
                                           r"\(see dr-scale estimate --help\)$"):
        parse(build_parser(), ["estimate", "--ds_config", "zero3", "a=1", "--bogus"])


def llama_1b_on_4_cpu_ranks(*overrides):
    """(run config, filled bundled zero3) for llama_1b with the bundled tokenizer's vocabulary on
    4 CPU ranks, micro-batch 1 x 256 tokens, bf16."""
    from dr_scale.config import ds_config as dsc
    from dr_scale.config import load_config

    cfg = load_config(None, ["model.preset=llama_1b", "model.vocab_size=4096",
                             "data.seq_length=256", "train.micro_batch_size=1", *overrides])
    ds = dsc.fill(dsc.read_json(dsc.resolve_path("zero3")), cfg, 4, source="zero3.json",
                  bf16_native=True, device_type="cpu")
    return cfg, ds


@pytest.mark.parametrize("zero, names", [
    ({"sub_group_size": 1e9}, "zero_optimization.sub_group_size 5e7"),
    ({}, "zero_optimization.stage3_max_live_parameters and stage3_max_reuse_distance 1e8"),
])
def test_a_zero3_refusal_names_the_working_set_that_fits(monkeypatch, zero, names):
    """Under ZeRO-3 the cheapest changes are DeepSpeed's own working sets: the step's fp32
    gradient made a sub-group at a time (free), then fewer gathered parameters kept live (more
    all-gathers), before checkpointing or offload. llama_1b on 4 CPU ranks, a rank given room
    for the smaller working set only (the real estimate either side of it)."""
    from dr_scale.errors import DrScaleError
    from dr_scale.parallel import memory_guard
    from dr_scale.parallel.estimate import estimate, inputs_for_run, shape_for_run

    cfg, ds = llama_1b_on_4_cpu_ranks("train.release_host_memory=true")
    ds["zero_optimization"].update(zero)
    shape, inputs = shape_for_run(cfg), inputs_for_run(cfg, ds, Topology(4))
    before = estimate(shape, inputs).peak
    after = estimate(shape, dataclasses.replace(inputs, sub_group_size=5e7,
                                                max_live_parameters=1e8)).peak
    if "sub_group_size" in zero:
        after = estimate(shape, dataclasses.replace(inputs, sub_group_size=5e7)).peak
    assert after < before
    limit = (after + before) // 2
    monkeypatch.setattr(memory_guard, "rank_limit", lambda device, world: (limit, "as given"))
    with pytest.raises(DrScaleError, match=re.escape(f"cheapest change that fits: {names} (")):
        memory_guard.refuse_if_too_big(cfg, ds, Topology(4), "cpu", "zero3.json")


def test_a_cpu_rank_that_keeps_freed_pages_needs_room_for_them(monkeypatch):
    """Without train.release_host_memory glibc keeps freed pages the estimate takes as given
    back (a rank was killed for memory at 1.04x of an estimate that had passed): on a CPU the
    estimate must fit with 60% to spare, and handing the pages back is the first change named.
    With it on, the same estimate fits the same limit."""
    from dr_scale.errors import DrScaleError
    from dr_scale.parallel import memory_guard
    from dr_scale.parallel.estimate import estimate_for_run

    cfg, ds = llama_1b_on_4_cpu_ranks("model.num_layers=8")
    need = estimate_for_run(cfg, ds, Topology(4)).peak
    limit = int(need * 1.1)
    monkeypatch.setattr(memory_guard, "rank_limit", lambda device, world: (limit, "as given"))
    with pytest.raises(DrScaleError) as refused:
        memory_guard.refuse_if_too_big(cfg, ds, Topology(4), "cpu", "zero3.json")
    line = str(refused.value)
    assert "x1.6 for the freed pages glibc keeps without train.release_host_memory" in line
    assert "cheapest change that fits: train.release_host_memory=true (" in line
    released, _ = llama_1b_on_4_cpu_ranks("model.num_layers=8", "train.release_host_memory=true")
    memory_guard.refuse_if_too_big(released, ds, Topology(4), "cpu", "zero3.json")  # fits: no error
    # a GPU's memory has no glibc between it and the allocator
    memory_guard.refuse_if_too_big(cfg, ds, Topology(4), "cuda", "zero3.json")
