"""What a requeued attempt meets at its start, found by the rehearsal (benchmarks/rehearsal.py):
a run folder holding only the sbatch script's failure record (its first attempt failed before
the run wrote anything) starts fresh under --resume auto, and a rendezvous port already taken
is one line with the exit code of a fault, not a traceback."""
import types
from pathlib import Path

import torch.distributed as dist

from dr_scale.checkpoint.resume import resume_decision
from dr_scale.runtime import hangs


def test_a_folder_with_only_the_failure_record_starts_fresh(tmp_path):
    for record in ("slurm_failures", "suspect_hosts"):
        run = tmp_path / record
        run.mkdir()
        (run / record).write_text("job 1 exit 1 2026-12-07T13:15:20+00:00 latest none\n")
        args = types.SimpleNamespace(resume="auto", run_dir=str(run))
        assert resume_decision(args) == (False, True)  # fresh, in a run folder that never saved


def test_a_rendezvous_that_cannot_listen_is_one_line():
    exc = dist.DistNetworkError("The server socket has failed to listen on any local network "
                                "address. port: 20001, useIpv6: false, code: -98, name: "
                                "EADDRINUSE, message: address already in use")
    hangs.now("start-up")
    error = hangs.as_error(exc, 0)
    assert str(error) == (
        "rank 0: the process group could not start during start-up: The server socket has "
        "failed to listen on any local network address. port: 20001, useIpv6: false, code: "
        "-98, name: EADDRINUSE, message: address already in use (MASTER_ADDR/MASTER_PORT)")


def test_the_ranks_of_a_node_share_one_memory_figure():
    """Two ranks of one node (children of one launcher: here, this test): local rank 1 asks
    first, local rank 0 takes 512 MiB before it measures, as a sibling's start-up would. Both
    get rank 0's figure; measuring each for itself, they differed by those 512 MiB and the
    memory check could refuse one configuration with different lines on different ranks."""
    import os
    import subprocess
    import sys
    import time

    code = ("import os, sys, time, numpy; from dr_scale.runtime import node_memory\n"
            "hold = numpy.ones(512 << 20, numpy.uint8) if os.environ['LOCAL_RANK'] == '0' else 0\n"
            "print(node_memory.available_bytes(2))\n")
    env = lambda rank: dict(os.environ, LOCAL_RANK=str(rank))  # noqa: E731
    first = subprocess.Popen([sys.executable, "-c", code], env=env(1), stdout=subprocess.PIPE,
                             text=True)
    time.sleep(2.0)  # rank 1 waits for the figure; its own MemAvailable is the larger one
    second = subprocess.run([sys.executable, "-c", code], env=env(0), capture_output=True,
                            text=True, check=True)
    figures = {int(first.communicate(timeout=60)[0]), int(second.stdout)}
    assert len(figures) == 1, figures
    import psutil

    left = Path(f"/dev/shm/dr_scale_node_memory_{os.getpid()}_"
                f"{int(psutil.Process().create_time())}")
    assert int(left.read_text()) in figures  # the group's start removes it (forget)
    left.unlink()
