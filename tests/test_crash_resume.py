"""SIGKILL a 2-rank run mid-training and mid-checkpoint-write; the resumed run must log the
uninterrupted run's losses bitwise (fp32), with each step once in metrics.jsonl."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import PRETRAIN, free_port, launch
from tests.test_train_distributed import fp32_config, records

ARGS = ["data.seq_length=64", "train.max_steps=12", "train.warmup_steps=3",
        "train.log_interval=1", "train.eval_interval=6", "train.save_interval=3",
        "train.eval_samples=16", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.keep_checkpoints=2", "model.hidden_size=384", "model.ffn_hidden_size=1024",
        "logging.plot=false"]


def spawn(args, cache, log):
    env = dict(os.environ, DR_SCALE_CACHE=str(cache), OMP_NUM_THREADS="1")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(PRETRAIN),
           *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_when(proc, ready, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        if proc.poll() is not None:
            pytest.fail("the run ended before the moment to kill it came")
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("timed out waiting for the moment to kill")


def logged_steps(run):
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line).get("step"))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    ds = fp32_config(tmp, 3)
    run = tmp / "reference"
    launch(["--ds_config", ds, "--run_dir", run, *ARGS], 2, cache_dir)
    return ds, {r["step"]: r["loss"] for r in records(run) if "loss" in r}


@pytest.mark.parametrize("moment", ["mid_training", "mid_checkpoint_write"])
def test_sigkill_then_resume_reproduces_losses(moment, reference, cache_dir, tmp_path):
    ds, expected = reference
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    with open(tmp_path / "first.log", "w") as log:
        proc = spawn(["--ds_config", ds, "--run_dir", run, *ARGS], cache_dir, log)
        if moment == "mid_training":
            kill_when(proc, lambda: 5 in logged_steps(run))       # after ckpt 3, before ckpt 6
        else:
            kill_when(proc, lambda: (ckpt / ".incoming" / "step_00000006").exists())
    latest = (ckpt / "latest").read_text().strip()
    print(f"killed {moment}: latest={latest}")
    assert latest in ("step_00000003", "step_00000006")
    assert (ckpt / latest / "dr_scale_state_rank1.pt").exists()   # latest is always complete
    if moment == "mid_checkpoint_write" and latest == "step_00000003":
        assert not (ckpt / "step_00000006").exists()              # the half-written one is not
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume"], 2, cache_dir)
    assert f"resumed from {ckpt / latest}" in proc.stdout
    got = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 13))          # each step once
    assert {r["step"]: r["loss"] for r in got} == expected         # bitwise, fp32
    assert not (ckpt / ".incoming").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_00000009",
                                                                    "step_00000012"]


@pytest.fixture(scope="module")
def short_run(reference, cache_dir, tmp_path_factory):
    """A 3-step run with one checkpoint, copied by each bad-input test before damaging it."""
    ds, _ = reference
    run = tmp_path_factory.mktemp("short") / "run"
    launch(["--ds_config", ds, "--run_dir", run, *ARGS, "train.max_steps=3"], 2, cache_dir)
    return run


@pytest.mark.parametrize("damage, pattern", [
    (lambda c: (c / "latest").write_text("step_00000099\n"), r"latest: names step_00000099, which is missing"),
    (lambda c: (c / "latest").unlink(), r"checkpoints: no checkpoint \(no 'latest' file\)"),
    (lambda c: (c / "step_00000003" / "dr_scale_state_rank1.pt").unlink(),
     r"step_00000003: dr_scale state of 1 rank\(s\) but DeepSpeed shards of 2 \(incomplete checkpoint\)"),
    (lambda c: [f.write_bytes(f.read_bytes()[:1000]) for f in (c / "step_00000003").glob("zero_pp_rank_0_*model_states.pt")],
     r"step_00000003: DeepSpeed could not load it"),
    (lambda c: [f.unlink() for f in (c / "step_00000003").glob("dr_scale_state_rank*.pt")],
     r"step_00000003: not a dr_scale checkpoint"),
])
def test_bad_checkpoints_are_one_line_errors_and_nothing_is_overwritten(
        damage, pattern, reference, short_run, cache_dir, tmp_path):
    import hashlib
    import re

    import shutil

    ds, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    damage(run / "checkpoints")
    digest = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
                      for p in sorted(run.rglob("*")) if p.is_file()}
    before = digest()
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume"], 2, cache_dir, check=False)
    assert proc.returncode != 0
    errors = [l for l in (proc.stdout + proc.stderr).splitlines() if "dr_scale: error:" in l]
    assert errors and re.search(pattern, errors[0]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    after = digest()
    assert {k: v for k, v in after.items() if "resumes" not in str(k)} == before


def test_checkpoint_of_another_shape_is_refused(reference, short_run, cache_dir, tmp_path):
    import shutil

    ds, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", "model.num_layers=2"], 2,
                  cache_dir, check=False)
    assert "checkpoint of another model shape: num_layers=4 (this run: 2)" in proc.stderr


def test_resume_with_another_tokenizer_is_refused(reference, short_run, cache_dir, tmp_path):
    import shutil

    from dr_scale.data.corpus import CORPUS
    from dr_scale.data.preprocess import iter_documents
    from dr_scale.data.tokenizer import train_tokenizer

    ds, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    other = train_tokenizer(iter_documents([CORPUS]), tmp_path / "other", 2048)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", f"data.tokenizer={other}"],
                  2, cache_dir, check=False)
    assert proc.returncode == 2
    assert "tokenizer.model: the run was trained with this tokenizer, but the resumed config " \
           f"gives {other}" in proc.stderr
