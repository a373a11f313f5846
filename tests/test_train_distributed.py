"""Real DeepSpeed engines on 2 CPU ranks over gloo: the README's job and the launchers (DeepSpeed's
launcher, two nodes, torchrun), and ranks started as the DeepSpeed launcher starts them."""
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from dr_scale.config import load_config
from dr_scale.train.schedule import lr_at
from tests.conftest import PRETRAIN, free_port, launch

SHORT = ["data.seq_length=64", "train.max_steps=16", "train.warmup_steps=4",
         "train.log_interval=4", "train.eval_interval=16", "train.save_interval=16",
         "train.eval_samples=16", "logging.plot=false", "logging.tensorboard=false"]


def records(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evals(run_dir):
    return [r for r in records(run_dir) if "eval_loss" in r]


def readme_main_job(cache_dir, run, stop_at_step: int):
    """`deepspeed launchers/pretrain.py --ds_config zero3.json` as the README writes it (threads
    from the cores), into `run`, ended after `stop_at_step`; the finished process."""
    env = dict(os.environ, DR_SCALE_CACHE=str(cache_dir))
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(["deepspeed", "--master_port", str(free_port()), str(PRETRAIN),
                           "--ds_config", "zero3.json", "--run_dir", str(run),
                           "--stop_at_step", str(stop_at_step)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_readme_main_job(cache_dir, tmp_path):
    """The README's command as written (one rank here), bounded on any CPU by `--stop_at_step
    100`, which only ends the same run early (schedule, data and seed unchanged): the precision
    follows the hardware, the held-out loss falls >= 40% by step 100 (measured 8.360 -> 4.787 in
    bf16 on an AVX512-BF16 EPYC, 8.360 -> 4.802 in fp32 with oneDNN capped below bf16), and the
    run folder is complete. The 2-rank form is covered by the shorter runs below."""
    from dr_scale.runtime.hardware import cpu_bf16_support

    run = tmp_path / "run"
    proc = readme_main_job(cache_dir, run, 100)
    bf16 = cpu_bf16_support()
    precision = "bf16" if bf16.native else "fp32"
    assert "dr_scale: 1 rank(s)" in proc.stdout
    assert f"ZeRO-3, {precision} (bf16 \"auto\": {bf16.why})" in proc.stdout
    # MFU's denominator, said at start: measured in the run's dtype at its largest GEMM (8 x 256
    # tokens x hidden 256 x vocabulary 4096); threads from the cores when OMP_NUM_THREADS is unset
    assert re.search(rf"peak \(MFU's denominator\): [0-9.]+ TFLOP/s per rank, measured "
                     rf"{precision} matmul 2048x256x4096", proc.stdout)
    threads = os.cpu_count()
    assert f"{threads} thread(s) per rank ({threads} cores / 1 rank(s) on this node)" in proc.stdout
    assert "host memory: freed blocks kept for the next step's tensors" in proc.stdout
    ev = evals(run)
    assert [r["step"] for r in ev] == [0, 100]
    assert ev[-1]["eval_loss"] <= 0.6 * ev[0]["eval_loss"], ev
    train = [r for r in records(run) if "loss" in r]
    assert len(train) == 10 and train[-1]["step"] == 100
    for r in train:
        assert {"step", "loss", "lr", "tokens_per_s", "tflops", "mfu", "mem_peak_bytes"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["mem_peak_bytes"] > 2**20
    # the 400-step schedule, stopped early (a record's lr is the one its last step used)
    assert train[-1]["lr"] == pytest.approx(lr_at(load_config().train, 99), rel=1e-9)
    # Everything needed to reproduce: resolved configs, versions, commit, layout, tokenizer.
    snap, default = load_config(run / "config.yaml").to_dict(), load_config().to_dict()
    assert snap["data"].pop("cache_dir") == str(cache_dir)  # resolved from ${env:DR_SCALE_CACHE}
    default["data"].pop("cache_dir")
    assert snap == default
    ds = json.loads((run / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"], ds["zero_optimization"]["stage"]) == (8, 8, 1, 3)
    assert ds["bf16"]["enabled"] is bf16.native
    info = json.loads((run / "run.json").read_text())
    assert info["world"]["world_size"] == 1 and info["packages"]["deepspeed"]
    assert "commit" in info["git"]
    assert (run / "tokenizer.model").stat().st_size > 1000
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000100"
    import matplotlib.image

    img = matplotlib.image.imread(run / "curves.png")
    assert img.shape[0] > 200 and img.shape[1] > 400
    # What is drawn: the train and held-out losses and tokens/s of metrics.jsonl, step by step.
    from dr_scale.train.metrics import read_metrics
    from dr_scale.train.plot import draw_curves

    recs = read_metrics(run / "metrics.jsonl")
    loss_ax, tput_ax = draw_curves(recs).axes
    train_line, eval_line = loss_ax.get_lines()
    train = [r for r in recs if "loss" in r]
    assert list(train_line.get_xdata()) == [r["step"] for r in train] and len(train) >= 10
    assert list(train_line.get_ydata()) == [r["loss"] for r in train]
    assert list(eval_line.get_ydata()) == [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert list(tput_ax.get_lines()[0].get_ydata()) == [r["tokens_per_s"] for r in train]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.smoke
def test_readme_main_job_first_30_steps(cache_dir, tmp_path):
    """The smoke stage's form of the README's command (on the oldest torch the package admits):
    the same run, stopped at step 30 (`--stop_at_step` ends it early, schedule and data
    unchanged): it starts, trains (the loss of steps 21-30 below that of steps 1-10 by 1.0 or
    more: 7.75 -> 5.81 in bf16 on an AMX Xeon) and saves step 30. On torch 2.13 the whole suite
    runs the 100-step form above."""
    run = tmp_path / "run"
    readme_main_job(cache_dir, run, 30)
    import torch

    info = json.loads((run / "run.json").read_text())
    # the torch under test ran it (the CUDA build's metadata drops the "+cu130")
    assert info["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    train = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30]
    assert train[-1]["loss"] <= train[0]["loss"] - 1.0, train
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000030"


# ZeRO-1 trains in the resume, crash and parallelism tests; these are the stages it leaves
@pytest.mark.parametrize("ds_config", ["zero0", "zero2", "zero3_offload"])
def test_every_zero_stage_trains(ds_config, cache_dir, tmp_path):
    run = tmp_path / "run"
    # wandb rides along on one of them: offline, no network, and the run must not care.
    wandb = ["logging.wandb=true", "logging.wandb_mode=offline"] if ds_config == "zero2" else []
    launch(["--ds_config", ds_config, "--run_dir", run, *SHORT, *wandb], 2, cache_dir)
    ev = evals(run)
    # 16 steps of 8 x 64 tokens: measured 8.357 -> 6.062 (0.73) at ZeRO-1, 2 ranks
    assert ev[-1]["eval_loss"] <= 0.8 * ev[0]["eval_loss"], ev
    if wandb:
        assert list((run / "wandb").glob("offline-run-*"))


def fp32_config(tmp_path, stage):
    ds = json.loads((PRETRAIN.parent.parent / "ds_configs" / f"zero{stage}.json").read_text())
    ds["bf16"] = {"enabled": False}
    path = tmp_path / f"zero{stage}_fp32.json"
    path.write_text(json.dumps(ds))
    return path


RESUME = ["data.seq_length=64", "train.max_steps=12", "train.warmup_steps=3",
          "train.log_interval=1", "train.eval_interval=6", "train.save_interval=6",
          "train.eval_samples=16", "train.micro_batch_size=2", "train.global_batch_size=8",
          "logging.plot=false", "logging.tensorboard=false"]


# fp32 ZeRO-3 is compared bitwise, after SIGKILLs, in test_crash_resume.py.
@pytest.mark.smoke
@pytest.mark.parametrize("precision, stage", [("bf16", 1)])
def test_resume_reproduces_the_uninterrupted_run(precision, stage, cache_dir, tmp_path):
    ds = str(fp32_config(tmp_path, stage)) if precision == "fp32" else f"zero{stage}"
    full, split = tmp_path / "full", tmp_path / "split"
    launch(["--ds_config", ds, "--run_dir", full, *RESUME], 2, cache_dir)
    # wandb (offline) rides along on the split run: one training run stays one wandb run.
    # The split run logs steps 1-8 and is lost before step 8's checkpoint: resumed at step 6.
    wandb = ["logging.wandb=true", "logging.wandb_mode=offline"]
    launch(["--ds_config", ds, "--run_dir", split, *RESUME, *wandb, "--stop_at_step", 8], 2,
           cache_dir)
    assert [r["step"] for r in records(split) if "loss" in r] == list(range(1, 9))
    for later in (split / "checkpoints").glob("step_*"):
        if later.name > "step_00000006":
            shutil.rmtree(later)
    (split / "checkpoints" / "latest").write_text("step_00000006\n")
    proc = launch(["--ds_config", ds, "--run_dir", split, "--resume"], 2, cache_dir)
    assert "resumed from" in proc.stdout and "at step 6 (48 samples consumed)" in proc.stdout
    a = {r["step"]: r for r in records(full) if "loss" in r}
    b = {r["step"]: r for r in records(split) if "loss" in r}
    assert sorted(a) == sorted(b) == list(range(1, 13))
    # What the wandb client sent: the resumed segment rewinds the run to step 6 (by id alone
    # the server would drop steps 7 and 8, already logged), then steps 7-12 with the run's
    # losses.
    run_id = (split / "wandb_run_id").read_text().strip()
    offline = sorted((split / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.endswith(f"-{run_id}") for p in offline)
    (first_branch, first), (branch, resumed) = (wandb_sent(p) for p in offline)
    assert first_branch is None and sorted(first) == list(range(1, 9))
    assert branch == {"run_id": run_id, "step": 6}
    assert sorted(resumed) == list(range(7, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(b[step]["loss"], rel=1e-6), step
    for step in range(1, 13):
        if precision == "fp32":
            assert b[step]["loss"] == a[step]["loss"], step       # bitwise
        else:
            assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=4e-3), step
        assert b[step]["lr"] == a[step]["lr"]
        assert b[step]["consumed_tokens"] == a[step]["consumed_tokens"]
    ea = [r["eval_loss"] for r in evals(full)]
    eb = [r["eval_loss"] for r in evals(split)]
    assert len(ea) == len(eb) == 3
    if precision == "fp32":
        assert ea == eb


def wandb_sent(offline_run: Path):
    """(the branch point, {step: loss}) that a wandb offline run's client recorded to send: its
    .wandb file, a log of records in 32 KiB blocks (each record: 4 bytes checksum, 2 bytes
    length, 1 byte kind: whole, first, middle, last), after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data = next(offline_run.glob("run-*.wandb")).read_bytes()
    pos, block, pieces, branch, losses = 7, 32768, b"", None, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pieces = (b"" if kind in (1, 2) else pieces) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pieces)
        if record.WhichOneof("record_type") == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            branch = config.get("_wandb", {}).get("branch_point")
        elif record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            if "loss" in items:
                losses[record.history.step.num] = items["loss"]
    return branch, losses


def test_launchers_and_two_nodes_give_the_same_losses(cache_dir, tmp_path):
    """One world of 2 ranks started four ways: the DeepSpeed launcher on one node (reference),
    torchrun on one node, and two nodes of one rank each through either launcher."""
    args = ["--ds_config", "zero2", *SHORT, "train.max_steps=4", "train.log_interval=1",
            "train.eval_interval=4", "train.save_interval=4", "train.warmup_steps=2"]
    launch(["--run_dir", tmp_path / "ds", *args], 2, cache_dir)
    env = dict(os.environ, DR_SCALE_CACHE=str(cache_dir), OMP_NUM_THREADS="1")
    proc = subprocess.run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                           str(PRETRAIN), "--run_dir", str(tmp_path / "tr"), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 thread(s) per rank (OMP_NUM_THREADS=1)" in proc.stdout  # set, so respected
    a = [r["loss"] for r in records(tmp_path / "ds") if "loss" in r]
    b = [r["loss"] for r in records(tmp_path / "tr") if "loss" in r]
    assert len(a) == 4 and a == b

    # The same world of 2 as two nodes of 1 rank on this machine, each node its own launcher
    # process: DeepSpeed's launcher without ssh (a hostfile, --node_rank), and torchrun --nnodes 2.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    for name in ("ds_2nodes", "torchrun_2nodes"):
        port = str(free_port())
        if name == "ds_2nodes":
            cmds = [["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(n),
                     "--master_addr", "127.0.0.1", "--master_port", port] for n in (0, 1)]
        else:
            cmds = [["torchrun", "--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1",
                     "--master_addr", "127.0.0.1", "--master_port", port] for n in (0, 1)]
        nodes = [subprocess.Popen([*c, str(PRETRAIN), "--run_dir", str(tmp_path / name), *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True) for c in cmds]
        try:
            outs = [node.communicate(timeout=600) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
        for node, (out, err) in zip(nodes, outs):
            assert node.returncode == 0, f"{name}: {(out + err)[-3000:]}"
        assert "2 rank(s) (1 on this node)" in outs[0][0], outs[0][0][-2000:]
        c = [r["loss"] for r in records(tmp_path / name) if "loss" in r]
        assert c == a, name


def test_accumulation_and_data_parallel_split_give_the_same_losses(cache_dir, tmp_path):
    """A global batch of 8 as 1 rank x 8, 1 rank x 4 x 2 accumulation, 2 ranks x 4: same samples,
    same gradients, so the same losses (fp32, within summation-order rounding)."""
    ds = str(fp32_config(tmp_path, 2))
    common = ["--ds_config", ds, *RESUME, "train.max_steps=6", "train.global_batch_size=8"]
    layouts = {"1x8": (1, 8), "1x4x2": (1, 4), "2x4": (2, 4)}
    losses = {}
    for name, (ranks, micro) in layouts.items():
        run = tmp_path / name
        launch(["--run_dir", run, *common, f"train.micro_batch_size={micro}"], ranks, cache_dir)
        losses[name] = [r["loss"] for r in records(run) if "loss" in r]
    assert len(losses["1x8"]) == 6
    for name in ("1x4x2", "2x4"):
        assert losses[name] == pytest.approx(losses["1x8"], rel=1e-5), name
    assert losses["1x8"][-1] < losses["1x8"][0]


def test_saves_by_time_come_at_one_step_on_every_rank(cache_dir, tmp_path):
    """train.save_interval_minutes: a save once that many minutes have passed on any rank's
    clock, at the same step on every rank (one flag in the per-step agreement), besides the
    steps' interval (here never: 1000) and the last step. 0.0001 minutes: every step."""
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero1", "--run_dir", run, "data.seq_length=64",
                   "train.max_steps=4", "train.save_interval=1000",
                   "train.save_interval_minutes=0.0001", "train.keep_checkpoints=0",
                   "train.eval_at_start=false", "train.eval_samples=4", "logging.plot=false"],
                  2, cache_dir)
    saved = [int(s) for s in re.findall(r"saved checkpoint \S+/step_(\d{8})", proc.stdout)]
    assert saved == [1, 2, 3, 4], proc.stdout[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == \
        [f"step_{s:08d}" for s in (1, 2, 3, 4)]
