import os

import torch

# Triton kernels run on CPU tensors through the interpreter; the flag must be set before any
# @triton.jit function is defined. On a machine with a GPU they run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "launchers" / "pretrain.py"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache of the bundled tokenizer + dataset for the whole session."""
    path = tmp_path_factory.mktemp("dr_scale_cache")
    from dr_scale.data.corpus import bundled_data

    bundled_data(path, 4096)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_script(name: str, *args, timeout=300):
    """tests/scripts/<name> with a free port and `args`: scripts that spawn their own ranks
    (torch.multiprocessing) on a real gloo group; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / name),
                           str(free_port()), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_group(cmd, env, timeout):
    """Run cmd in its own process group; on timeout kill the whole group (launcher and ranks)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def stopped_at(full, run, step: int):
    """Copy the run folder `full` to `run` as a run stopped (or killed) after its checkpoint at
    `step` would leave it: the same deterministic steps wrote the same checkpoint, so the
    uninterrupted run's copy serves. The records it logged later are set aside by the resume
    itself (metrics.superseded.jsonl)."""
    shutil.copytree(full, run)
    ckpt = run / "checkpoints"
    for later in ckpt.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (ckpt / "latest").write_text(f"step_{step:08d}\n")


def launch(args, ranks: int, cache, timeout=300, check=True, launcher="deepspeed"):
    """Run launchers/pretrain.py under the real DeepSpeed launcher with `ranks` CPU ranks; a
    launch past `timeout` is killed with all its ranks and fails the test. One rank starts as
    `python pretrain.py` either way: the launcher's two interpreters of its own (runner, then
    per-node launch, each importing DeepSpeed) cost ~4.5 s a launch, and the launcher forms
    have tests of their own (the README's main job, launchers and nodes, the installed module)."""
    env = dict(os.environ, DR_SCALE_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # threads per rank: cores / ranks, whatever the shell has
    if launcher == "deepspeed" and ranks > 1:
        cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()),
               str(PRETRAIN), *map(str, args)]
    else:
        cmd = [sys.executable, str(PRETRAIN), *map(str, args)]
    code, out, err = run_group(cmd, env, timeout)
    if code is None:
        raise AssertionError(f"launch hung for {timeout}s and was killed:\n{(out + err)[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, code, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"launcher failed ({proc.returncode}):\n"
                             + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return proc
