"""What a requeued attempt meets at its start, found by the rehearsal (benchmarks/rehearsal.py):
a run folder holding only the sbatch script's failure record (its first attempt failed before
the run wrote anything) starts fresh under --resume auto, and a rendezvous port already taken
is one line with the exit code of a fault, not a traceback."""
import types

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
