"""Hosts a failed attempt suspects, for the sbatch script to keep out of the next one.

A rank that knows which node failed writes one line to the run folder's `suspect_hosts`:
the watchdog (the nodes of ranks whose heartbeat stopped; written by one surviving rank) and a
rank whose own storage failed (EIO). launchers/slurm_pretrain.sbatch reads the lines of the
attempt that just failed and resubmits the job with those nodes excluded (`--exclude`, at most
DR_SCALE_MAX_EXCLUDED, never so many that the partition cannot hold the job). Only under SLURM:
elsewhere nothing reads them. Node names are SLURM's (SLURMD_NODENAME), which `--exclude` takes.
"""
import os
import socket
from pathlib import Path
from typing import Iterable, Optional

FILE = "suspect_hosts"


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def note(run_dir: Optional[Path], hosts: Iterable[str], why: str):
    """One line a host: `job J attempt A host H why`, appended in one write each."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None or run_dir is None or not Path(run_dir).is_dir():
        return
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    reason = " ".join(why.split())[:200]
    with open(Path(run_dir) / FILE, "a") as f:
        for host in dict.fromkeys(hosts):
            f.write(f"job {job} attempt {attempt} host {host} {reason}\n")
            f.flush()
