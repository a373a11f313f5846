import os

import torch

# Triton kernels run on CPU tensors through the interpreter; the flag must be set before any
# @triton.jit function is defined. On a machine with a GPU they run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs WORKERS test processes side by side: each gets its share of the cores, in
# process and in what it launches. More threads than cores makes OpenMP's waiting threads spin
# against each other's work: beside a 2-rank run on 2 cores, a 30-step in-process training test
# took 51 s instead of 2.8 s, and a 1-rank launch 48.6 s instead of 10.5 s (AVX2-only EPYC).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES_PER_WORKER = max(1, (os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    torch.set_num_threads(CORES_PER_WORKER)
    os.environ.setdefault("OMP_NUM_THREADS", str(CORES_PER_WORKER))

import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "launchers" / "pretrain.py"


# The suite's runs save real DeepSpeed checkpoints: measured with 2 workers, its temporary
# folder held up to 3.5 GB at once (passing tests' folders are removed as they end: pytest.ini,
# module_folder). Started with less free, it fails part-way with errors that do not say why.
NEEDS_FREE_GB = 5


def pytest_sessionstart(session):
    base = session.config.option.basetemp or tempfile.gettempdir()
    while not os.path.isdir(base):  # a --basetemp not made yet: its parent's disk
        base = os.path.dirname(os.path.abspath(base))
    free = shutil.disk_usage(base).free / 1e9
    if free < NEEDS_FREE_GB:
        pytest.exit(f"tests: {free:.1f} GB free in {base}, {NEEDS_FREE_GB} GB needed (the suite "
                    f"holds up to 3.5 GB of checkpoints there at once): free some, or point "
                    f"--basetemp at a disk with room", returncode=2)


def module_folder(request, tmp_path_factory, name: str) -> Path:
    """A folder for a module-scoped fixture's runs, removed when the fixture is torn down if no
    test failed meanwhile (pytest.ini removes passing tests' own tmp_path at once; a module's
    shared runs would otherwise stay to the end of the session, gigabytes of checkpoints)."""
    path = tmp_path_factory.mktemp(name)
    failed_before = request.session.testsfailed

    def remove_if_all_passed():
        if request.session.testsfailed == failed_before:
            shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(remove_if_all_passed)
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache of the bundled tokenizer + dataset for the whole session."""
    path = tmp_path_factory.mktemp("dr_scale_cache")
    from dr_scale.data.corpus import bundled_data

    bundled_data(path, 4096)
    return path


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port the kernel hands out (bind to 0)
    can be handed again, before the rank binds it, to an outgoing connection (gloo's ranks of the
    other test worker open many): seen once in CI as EADDRINUSE at the rendezvous. Ports below
    ip_local_port_range are never given to outgoing connections."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # seeded from the OS: the test workers pick apart
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def run_rank_script(name: str, *args, timeout=300):
    """tests/scripts/<name> with a free port and `args`: scripts that spawn their own ranks
    (torch.multiprocessing) on a real gloo group; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / name),
                           str(free_port()), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_group(cmd, env, timeout, cwd=None):
    """Run cmd in its own process group; on timeout kill the whole group (launcher and ranks)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=cwd)
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


def launched_threads(ranks: int) -> int:
    """Threads per rank of a run `launch` starts with `ranks` ranks."""
    return max(1, (CORES_PER_WORKER if WORKERS > 1 else os.cpu_count() or 1) // ranks)


def launch(args, ranks: int, cache, timeout=300, check=True, launcher="deepspeed"):
    """Run launchers/pretrain.py on `ranks` CPU ranks over gloo; a launch past `timeout` is
    killed with all its ranks and fails the test. The ranks are started here as DeepSpeed's
    launcher starts them (`spawn_ranks`) rather than through it: its two interpreters (runner,
    then per-node launch, each importing DeepSpeed) cost ~7 s of a core a launch, a third of a
    short 2-rank run, and the launcher forms have tests of their own (the README's main job,
    launchers and nodes, the installed module, the signal and crash tests). The ranks are forked
    from this worker's `RankStarter`, which has imported torch and DeepSpeed once;
    launcher="python" starts `python pretrain.py` as a fresh interpreter (the one-line error
    tests)."""
    env = dict(os.environ, DR_SCALE_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # threads per rank: cores / ranks, whatever the shell has
    if WORKERS > 1:  # ... of this worker's cores
        env["DR_SCALE_THREADS_PER_RANK"] = str(launched_threads(ranks))
    cmd = [sys.executable, str(PRETRAIN), *map(str, args)]
    if launcher == "deepspeed":
        code, out, err = spawn_ranks(cmd, ranks, env, timeout)
    else:
        code, out, err = run_group(cmd, env, timeout)
    if code is None:
        raise AssertionError(f"launch hung for {timeout}s and was killed:\n{(out + err)[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, code, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"launcher failed ({proc.returncode}):\n"
                             + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return proc


class RankStarter:
    """This test worker's fork server of ranks (tests/scripts/rank_zygote.py: imports paid once
    per worker, not per rank). `start` returns a rank's (id, pid); `poll` by id its exit status
    once it has ended (as subprocess reports it), else None."""

    _one = None

    @classmethod
    def get(cls) -> "RankStarter":
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
        return cls._one

    def __init__(self):
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)  # each rank sets its threads (process_group.py)
        self.proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests" / "scripts" /
                                                                "rank_zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT, start_new_session=True)
        self.cond, self.started, self.exited, self.next_id = threading.Condition(), {}, {}, 0

        def read():
            for line in self.proc.stdout:
                message = json.loads(line)
                with self.cond:
                    if "started" in message:
                        self.started[message["started"]] = message["pid"]
                    else:
                        self.exited[message["exited"]] = message["code"]
                    self.cond.notify_all()
            with self.cond:
                self.cond.notify_all()
        threading.Thread(target=read, daemon=True).start()

    def start(self, argv, env, out: str, err: str, group: int = 0) -> tuple:
        with self.cond:
            self.next_id += 1
            ident = self.next_id
            self.proc.stdin.write(json.dumps(
                {"id": ident, "argv": argv, "cwd": str(ROOT), "env": env, "out": out,
                 "err": err, "group": group}) + "\n")
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: ident in self.started or
                                      self.proc.poll() is not None, timeout=60):
                raise AssertionError("the rank fork server did not start a rank in 60 s")
            if ident not in self.started:
                raise AssertionError(f"the rank fork server ended ({self.proc.returncode})")
            return ident, self.started.pop(ident)

    def poll(self, ident: int):
        with self.cond:
            return self.exited.get(ident)

    def wait(self, ident: int, timeout: float):
        with self.cond:
            self.cond.wait_for(lambda: ident in self.exited, timeout=timeout)
            return self.exited.get(ident)


def spawn_ranks(cmd, ranks: int, env, timeout):
    """`cmd` as `ranks` local ranks with the environment DeepSpeed's launcher gives each
    (deepspeed/launcher/launch.py: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK/SIZE,
    MASTER_ADDR/PORT and `--local_rank=N`; one rank: `python pretrain.py args` as is), forked by
    this worker's `RankStarter`, and DeepSpeed's launcher's rule for failures: the first rank to
    exit non-zero ends the others (SIGTERM, SIGKILL 30 s later) and its code is the launch's.
    All ranks share one process group, so a timeout kills them and anything they started.
    Returns (code or None on timeout, stdout, stderr), each stream the ranks' lines interleaved
    as they came."""
    port = str(free_port())
    starter = RankStarter.get()
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        ranks_started = []  # (id, pid)
        for rank in range(ranks):
            rank_env, argv = dict(env), [cmd[1], *cmd[2:]]
            if ranks > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                LOCAL_SIZE=str(ranks), CROSS_RANK="0", CROSS_SIZE="1",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                argv = [cmd[1], f"--local_rank={rank}", *cmd[2:]]
            group = ranks_started[0][1] if ranks_started else 0  # 0: a new one, led by rank 0
            ranks_started.append(starter.start(argv, rank_env, out, err, group=group))
        deadline, code = time.monotonic() + timeout, 0
        while True:
            codes = [starter.poll(ident) for ident, _ in ranks_started]
            code = next((c for c in codes if c), 0)
            if code or all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                code = None
                break
            time.sleep(0.05)
        if code != 0:
            _end_ranks(starter, ranks_started, hard=code is None)
        read = lambda path: open(path).read() if os.path.exists(path) else ""  # noqa: E731
        return code, read(out), read(err)


def _end_ranks(starter, ranks_started, hard: bool):
    """SIGTERM (or, after a timeout, SIGKILL) every process in the ranks' group; SIGKILL what is
    left 30 s after a SIGTERM, as DeepSpeed's launcher does."""
    group = ranks_started[0][1]
    try:
        os.killpg(group, signal.SIGKILL if hard else signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    for ident, _ in ranks_started:
        starter.wait(ident, max(0.0, deadline - time.monotonic()))
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for ident, _ in ranks_started:
        starter.wait(ident, 30)

