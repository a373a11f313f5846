"""SIGKILL a 2-rank run mid-training and mid-checkpoint-write; the resumed run must log the
uninterrupted run's losses bitwise (fp32), with each step once in metrics.jsonl."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dr_scale.errors import EXIT_FAULT
from tests.conftest import PRETRAIN, free_port, launch, module_folder
from tests.test_train_distributed import fp32_config, records

ARGS = ["data.seq_length=64", "train.max_steps=12", "train.warmup_steps=3",
        "train.log_interval=1", "train.eval_interval=6", "train.save_interval=3",
        "train.eval_samples=16", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.keep_checkpoints=2", "model.hidden_size=128", "model.ffn_hidden_size=352",
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
def reference(request, cache_dir, tmp_path_factory):
    tmp = module_folder(request, tmp_path_factory, "crash")
    ds = fp32_config(tmp, 3)
    run = tmp / "reference"
    launch(["--ds_config", ds, "--run_dir", run, *ARGS], 2, cache_dir)
    return ds, {r["step"]: r["loss"] for r in records(run) if "loss" in r}, run


# A SIGKILL between saves is the elastic test's (rank 1 killed after step 5) and ends the same way
@pytest.mark.parametrize("moment", ["mid_checkpoint_write", "mid_async_write"])
def test_sigkill_then_resume_reproduces_losses(moment, reference, cache_dir, tmp_path):
    """mid_async_write: with train.async_save, killed while the writer thread writes step 6's
    files behind step 7; the run resumes from an asynchronously written checkpoint."""
    ds, expected, _ = reference
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    extra = ["train.async_save=true"] if moment == "mid_async_write" else []
    with open(tmp_path / "first.log", "w") as log:
        proc = spawn(["--ds_config", ds, "--run_dir", run, *ARGS, *extra], cache_dir, log)
        kill_when(proc, lambda: (ckpt / ".incoming" / "step_00000006").exists())
    latest = (ckpt / "latest").read_text().strip()
    print(f"killed {moment}: latest={latest}")
    assert latest in ("step_00000003", "step_00000006")
    assert (ckpt / latest / "dr_scale_state_rank1.pt").exists()   # latest is always complete
    if latest == "step_00000003":
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
def short_run(request, reference, cache_dir, tmp_path_factory):
    """A 3-step run with one checkpoint, copied by each bad-input test before damaging it."""
    ds, _, _ = reference
    run = module_folder(request, tmp_path_factory, "short") / "run"
    launch(["--ds_config", ds, "--run_dir", run, *ARGS, "train.max_steps=3"], 2, cache_dir)
    return run


@pytest.mark.parametrize("damage, pattern", [
    (lambda c: (c / "latest").unlink(), r"checkpoints: no checkpoint \(no 'latest' file\)"),
    (lambda c: (c / "step_00000003" / "dr_scale_state_rank1.pt").unlink(),
     r"checkpoints: no intact checkpoint: step_00000003: dr_scale_state_rank1.pt is missing"),
    (lambda c: [f.write_bytes(f.read_bytes()[:1000]) for f in (c / "step_00000003").glob("zero_pp_rank_0_*model_states.pt")],
     r"no intact checkpoint: step_00000003: zero_pp_rank_0_mp_rank_00_model_states.pt has 1000 "
     r"bytes, its manifest \d+"),
    (lambda c: (c / "step_00000003" / "manifest.json").write_text("{"),
     r"no intact checkpoint: step_00000003: manifest.json unreadable"),
    # a checkpoint of a version without manifests goes by DeepSpeed's checks alone
    (lambda c: [(c / "step_00000003" / "manifest.json").unlink(),
                (c / "step_00000003" / "dr_scale_state_rank1.pt").unlink()],
     r"step_00000003: dr_scale state of 1 rank\(s\) but DeepSpeed shards of 2 \(incomplete checkpoint\)"),
])
def test_bad_checkpoints_are_one_line_errors_and_nothing_is_overwritten(
        damage, pattern, reference, short_run, cache_dir, tmp_path):
    import hashlib
    import re

    import shutil

    ds, _, _ = reference
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
    # the one file a resume may add: the note that the checkpoint is damaged, its fault kept
    notes = [k for k in after if k.name == "damaged.json"]
    for note in notes:
        assert re.search(pattern.split(": ", 2)[-1], json.loads(note.read_text())["fault"])
    assert {k: v for k, v in after.items() if "resumes" not in str(k) and k not in notes} \
        == before


def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(reference, cache_dir, tmp_path):
    """Bytes flipped inside step 12's largest file, its size unchanged (a load would read wrong
    numbers without a word): `dr-scale verify` names the file, and --resume says so in one line,
    continues from step 9 and logs the reference's losses again for steps 10-12."""
    import shutil

    ds, expected, reference_run = reference
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    ckpt = run / "checkpoints"
    victim = max((ckpt / "step_00000012").glob("*.pt"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    check = subprocess.run([sys.executable, "-m", "dr_scale.cli", "verify", "--run_dir", str(run),
                            "--workers", "2"], capture_output=True, text=True)
    assert check.returncode == 2, check.stderr[-2000:]
    assert f"{ckpt / 'step_00000009'}: intact" in check.stdout
    assert f"{ckpt / 'step_00000012'}: NOT INTACT: {victim.name}: CRC-32" in check.stdout
    export = subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir", str(run),
                             "--out", str(tmp_path / "hf")], capture_output=True, text=True)
    assert export.returncode == 2 and not (tmp_path / "hf").exists()
    assert f"{ckpt / 'step_00000012'}: not intact ({victim.name}: CRC-32" in export.stderr
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume"], 2, cache_dir)
    warnings = [line for line in proc.stderr.splitlines() if "not intact" in line]
    assert len(warnings) == 1 and re.fullmatch(
        rf"dr_scale: warning: {re.escape(str(ckpt / 'step_00000012'))}: not intact "
        rf"\({re.escape(victim.name)}: CRC-32 [0-9a-f]{{8}}, its manifest [0-9a-f]{{8}} "
        rf"\(damaged\)\); resuming from step_00000009", warnings[0]), proc.stderr[-2000:]
    assert f"resumed from {ckpt / 'step_00000009'} at step 9" in proc.stdout
    got = {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert got == expected                                       # bitwise, fp32
    assert json.loads((ckpt / "step_00000012" / "manifest.json").read_text())["step"] == 12


def test_a_latest_naming_a_missing_folder_resumes_from_the_newest_intact(reference, short_run,
                                                                         cache_dir, tmp_path):
    """A save that replaced a step's folder and was killed between its renames leaves `latest`
    naming a folder that is gone: the resume takes the newest intact checkpoint before it and
    says so in one line (it used to stop as a configuration error, which is never requeued)."""
    import shutil

    ds, _, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    ckpt = run / "checkpoints"
    (ckpt / "latest").write_text("step_00000099\n")
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", "train.max_steps=4"], 2,
                  cache_dir)
    assert f"dr_scale: warning: {ckpt / 'step_00000099'}: not intact (latest names it, but its " \
           "folder is gone); resuming from step_00000003" in proc.stderr
    assert f"resumed from {ckpt / 'step_00000003'} at step 3" in proc.stdout
    assert (ckpt / "latest").read_text() == "step_00000004\n"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_that_cannot_be_written_stops_every_rank_in_one_line(mode, reference, short_run,
                                                                     cache_dir, tmp_path):
    """Files limited to half a ZeRO-3 optimizer shard (RLIMIT_FSIZE: a full disk as a write
    sees it; every other file the run writes is far smaller): the step-6 save fails on both
    ranks, each stops with one line naming its file and the exit code of a fault (a requeue
    may get past it; a configuration error's 2 would end a week-long job), and the step-3
    checkpoint stays the latest, byte for byte."""
    import hashlib
    import resource
    import shutil

    ds, _, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    ckpt = run / "checkpoints"
    digest = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
                      for p in sorted((ckpt / "step_00000003").iterdir())}
    before = digest()
    env = dict(os.environ, DR_SCALE_CACHE=str(cache_dir), OMP_NUM_THREADS="1")
    shard = min(p.stat().st_size for p in (ckpt / "step_00000003").glob("*optim_states.pt"))
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (shard // 2,) * 2)  # noqa: E731
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
                           str(PRETRAIN), "--ds_config", str(ds), "--run_dir", str(run),
                           "--resume", "train.max_steps=6", f"train.async_save={str(mode == 'async').lower()}"],
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    errors = [line for line in proc.stderr.splitlines() if "dr_scale: error:" in line]
    # a fault met while running, not a configuration error: a scheduler may retry it
    assert proc.returncode == EXIT_FAULT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for rank, line in enumerate(sorted(errors, key=lambda l: "[rank" in l)):
        assert re.search(rf"checkpoint step_00000006: \S+/zero_pp_rank_{rank}_mp_rank_00_optim_"
                         r"states.pt: could not be written \(.*GiB free there\); \S+latest still "
                         "names the previous checkpoint", line), errors
    assert len(errors) == 2
    assert (ckpt / "latest").read_text() == "step_00000003\n"
    assert digest() == before  # a resume's checks write nothing into an intact checkpoint
    assert not (ckpt / "step_00000006").exists()


def test_checkpoint_of_another_shape_is_refused(reference, short_run, cache_dir, tmp_path):
    import shutil

    ds, _, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", "model.num_layers=2"], 2,
                  cache_dir, check=False)
    assert "checkpoint of another model shape: num_layers=4 (this run: 2)" in proc.stderr


def test_resume_with_another_tokenizer_is_refused(reference, short_run, cache_dir, tmp_path):
    import shutil

    from dr_scale.data.corpus import CORPUS
    from dr_scale.data.text_files import iter_documents
    from dr_scale.data.tokenizer import train_tokenizer

    ds, _, _ = reference
    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    other = train_tokenizer(iter_documents([CORPUS]), tmp_path / "other", 2048)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", f"data.tokenizer={other}"],
                  2, cache_dir, check=False)
    assert proc.returncode == 2
    assert "tokenizer.model: the run was trained with this tokenizer, but the resumed config " \
           f"gives {other}" in proc.stderr


def stop_when(proc, ready, timeout=600):
    """SIGTERM to every rank (as a scheduler signals its tasks) once `ready()`."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            for p in psutil.Process(proc.pid).children(recursive=True):
                if "--local_rank" in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGTERM)
            return proc.wait(timeout=120)
        if proc.poll() is not None:
            pytest.fail("the run ended before the moment to stop it came")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("timed out waiting for the moment to stop")


def test_sigterm_saves_and_resume_auto_continues(reference, cache_dir, tmp_path):
    """One command for the first launch and every requeue: `--resume auto` starts fresh in an
    empty folder; SIGTERM stops both ranks at one step boundary with a checkpoint there (between
    the save interval's checkpoints) and exit status 75, passed on by DeepSpeed's launcher; the
    same command continues, and the losses are the uninterrupted run's, bitwise (fp32). (Stopped
    and requeued under a real SLURM: tests/test_slurm.py.)"""
    ds, expected, _ = reference
    run = tmp_path / "run"
    command = ["--ds_config", ds, "--run_dir", run, "--resume", "auto", *ARGS]
    with open(tmp_path / "first.log", "w") as log:
        proc = spawn(command, cache_dir, log)
        code = stop_when(proc, lambda: 4 in logged_steps(run))
    text = (tmp_path / "first.log").read_text()
    found = re.search(r"dr_scale: stopped: SIGTERM at step (\d+): checkpoint (\S+) saved", text)
    assert found, text[-3000:]
    stopped = int(found.group(1))
    assert code == 75, text[-2000:]  # the launcher passes the ranks' status on
    assert stopped >= 4 and (run / "checkpoints" / f"step_{stopped:08d}").is_dir()
    assert "resumed from" not in text  # --resume auto in an empty folder: a fresh start
    proc = launch(command, 2, cache_dir)
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped:08d}'}" in proc.stdout
    got = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 13))          # each step once
    assert {r["step"]: r["loss"] for r in got} == expected         # bitwise, fp32
    # and a folder that is not a run folder is refused, untouched
    other = tmp_path / "not_a_run"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    proc = launch(["--ds_config", ds, "--run_dir", other, "--resume", "auto", *ARGS], 2,
                  cache_dir, check=False)
    assert proc.returncode == 2 and "--resume auto: not a dr_scale run folder" in proc.stderr
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def long_run_past_step_3(run, *extra, cache, log):
    """A 2-rank run of 400 steps (spawned), returned once it logged step 3 (or ended)."""
    proc = spawn(["--ds_config", "zero1", "--run_dir", run, "data.seq_length=64",
                  "train.max_steps=400", "train.log_interval=1", "train.eval_interval=1000",
                  "train.save_interval=1000", "train.micro_batch_size=2",
                  "train.global_batch_size=8", "logging.plot=false", *extra], cache, log)
    deadline = time.time() + 300
    while 3 not in logged_steps(run) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    return proc


def test_a_rank_that_stops_responding_ends_the_run_in_one_line(cache_dir, tmp_path):
    """SIGSTOP to rank 1 mid-run: rank 0 waits train.collective_timeout_s (10 s here) in its
    next collective, then the run ends with one line naming rank 0 and the step and phase it
    was in, not a traceback and not the default 10-minute wait."""
    import psutil

    run = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = long_run_past_step_3(run, "train.collective_timeout_s=10", cache=cache_dir,
                                    log=log)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "--local_rank=1" in " ".join(p.cmdline())]
        assert len(ranks) == 1, "rank 1 not found"
        ranks[0].send_signal(signal.SIGSTOP)
        stopped = time.time()
        # rank 0's line, then the end of the group (DeepSpeed's launcher would wait 30 s more
        # for the stopped rank to take its SIGTERM: not ours to test)
        while "dr_scale: error:" not in (tmp_path / "log").read_text() and \
                time.time() < stopped + 90:
            time.sleep(0.1)
        waited = time.time() - stopped
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    text = (tmp_path / "log").read_text()
    found = re.search(r"dr_scale: error: rank 0: a collective failed during (step \d+[ \w-]*|"
                      r"evaluation at step \d+|checkpoint save at step \d+): .*Timed out.* "
                      r"\(train\.collective_timeout_s=10\); another rank stopped responding or "
                      r"died", text)
    assert found, text[-3000:]
    assert 10 <= waited < 90, waited
    assert "Traceback" not in text.split(found.group(0))[0][-2000:]


def test_a_silent_rank_is_named_by_the_step_deadline_with_its_host_and_pid(cache_dir, tmp_path):
    """SIGSTOP to rank 1 mid-run with the default collective timeout (600 s): the step deadline
    (max(train.step_timeout_min_s = 20 s here, 10 x the median step)) ends rank 0 within it
    plus two heartbeat intervals, with one line naming rank 1 as silent, its host, its pid and
    the step and phase of its last heartbeat (a beat every 5 s: with steps this fast, maybe
    the start), and the exit code of a fault (74: requeued)."""
    import socket

    import psutil

    run = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = long_run_past_step_3(run, "train.step_timeout_min_s=20", cache=cache_dir, log=log)
        ranks = {int(p.environ().get("RANK", -1)): p
                 for p in psutil.Process(proc.pid).children(recursive=True)
                 if "pretrain.py" in " ".join(p.cmdline())}
        ranks[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        while "dr_scale: error:" not in (tmp_path / "log").read_text() and \
                time.time() < stopped + 120:
            time.sleep(0.1)
        waited = time.time() - stopped
        ranks[0].wait(timeout=30)
        ranks[1].kill()  # what the scheduler does to the stopped rank when the step ends
        try:
            code = proc.wait(timeout=60)  # DeepSpeed's launcher passes rank 0's status on
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    found = re.search(r"dr_scale: error: step (\d+)( stop-signal agreement)? waited (\d+) s \(the "
                      r"deadline: 20 s = .*\); silent: rank 1 on (\S+) pid (\d+) at step (\d+) "
                      r"in '([^']*)', last collective '[^']*', no heartbeat for (\d+) s$",
                      text, re.M)
    assert found, text[-3000:]
    assert found.group(4) == socket.gethostname() and int(found.group(5)) == ranks[1].pid
    assert int(found.group(6)) <= int(found.group(1)) and 20 <= int(found.group(3)) <= 32
    assert 20 <= waited < 20 + 2 * 5 + 5, waited
    assert code == 74  # EXIT_FAULT: a scheduler retries it
    assert "Traceback" not in text


def test_torchrun_elastic_agent_restarts_a_group_that_lost_a_rank(reference, cache_dir,
                                                                   tmp_path):
    """launchers/torchrun_elastic.sh on 2 ranks: rank 1 is SIGKILLed after step 5 (a checkpoint
    at 3); the agent stops rank 0, starts the group again, and --resume auto continues from the
    checkpoint to the uninterrupted run's losses, bitwise (fp32), each step once."""
    import psutil

    ds, expected, _ = reference
    run = tmp_path / "run"
    env = dict(os.environ, DR_SCALE_CACHE=str(cache_dir), OMP_NUM_THREADS="1", NPROC_PER_NODE="2",
               MAX_RESTARTS="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", JOB_ID="elastic_test")
    script = PRETRAIN.parent / "torchrun_elastic.sh"
    with open(tmp_path / "elastic.log", "w") as log:
        proc = subprocess.Popen([str(script), "--ds_config", str(ds), "--run_dir", str(run),
                                 *ARGS], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

        def rank1():
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == "1" and "pretrain.py" in " ".join(
                            child.cmdline()):
                        return child
                except psutil.Error:
                    pass
        deadline = time.time() + 300
        while 5 not in logged_steps(run):
            assert proc.poll() is None and time.time() < deadline, "no step 5 before the kill"
            time.sleep(0.05)
        victim = rank1()
        victim.kill()
        try:
            code = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "elastic.log").read_text()
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert code == 0, "\n".join(errors[:20]) + text[-2000:]
    assert f"resumed from {run / 'checkpoints'}" in text  # the restarted group resumed
    got = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in got] == list(range(1, 13))          # each step once
    assert {r["step"]: r["loss"] for r in got} == expected         # bitwise, fp32
