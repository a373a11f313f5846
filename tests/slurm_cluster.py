"""A real one-node SLURM on this machine, for the tests and the rehearsal: Debian's slurm-wlm
and munge (the README's test section installs them), munged, slurmctld and slurmd started with
their own configuration in a folder of the caller's, and stopped (with any job left) at the
end. `cpus` declares more CPUs than the machine has (SlurmdParameters=config_overrides), so a
job of N tasks fits one node of a 2-core machine: a rehearsal of N ranks. `nodes` > 1 starts
that many slurmd on this machine, nodes n1, n2, ... (a slurmd each, on ports of their own), so a
job can be kept off one of them (--exclude)."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from tests.conftest import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
SLURM_CONF = """ClusterName=dr_scale_test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire before it starts again (120 s by default)
AuthInfo=socket={root}/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmMissing(RuntimeError):
    pass


@contextlib.contextmanager
def one_node_slurm(root: Path, cpus: Optional[int] = None, nodes: int = 1):
    """Yields the environment that reaches the cluster (SLURM_CONF set)."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        raise SlurmMissing(f"{', '.join(missing)} not found: these tests need Debian's "
                           "slurm-wlm and munge (apt-get install slurm-wlm munge, as the "
                           "README's test section says)")
    root = Path(root)
    for folder in ("state", "spool"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]  # NodeName=... CPUs=... RealMemory=
    if cpus is not None:  # declared, not real: the tasks share the machine's cores
        node = re.sub(r"CPUs=\d+", f"CPUs={cpus}", node)
        node = re.sub(r" (Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=\d+", "", node)
    host = re.search(r"NodeName=(\S+)", node).group(1)
    names = [host] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
    lines = [f"{node} State=UNKNOWN"] if nodes == 1 else [
        node.replace(f"NodeName={host}", f"NodeName={name} NodeHostname={host} "
                                         f"Port={free_port()}") + " State=UNKNOWN"
        for name in names]
    for name in names:
        (root / "spool" / name).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, root=root, nodes="\n".join(lines),
                                      names=",".join(names), ctld_port=free_port(),
                                      d_port=free_port()))
    # each cluster's jobs count from 1: ports of their own, should two clusters run at once
    env = dict(os.environ, SLURM_CONF=str(conf), DR_SCALE_PORT_BASE=str(free_port()))
    subprocess.run(["munged", "--force", f"--socket={root}/munge.socket",
                    f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munge.seed"], check=True, env=env)
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env)
    for name in names:
        subprocess.run(["slurmd", "-f", str(conf), *(["-N", name] if nodes > 1 else [])],
                       check=True, env=env)
    try:
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                                   text=True, env=env).stdout.split()
            if state == ["idle"] * nodes:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"SLURM's node did not come up ({state!r}):\n"
                               + (root / "slurmctld.log").read_text()[-2000:])
        yield env
    finally:  # a job left running (a failed test) is ended before the daemons
        subprocess.run(["scancel", "--full", "--quiet", "--user", "root"], env=env)
        deadline = time.time() + 60
        while time.time() < deadline and subprocess.run(
                ["squeue", "-h"], capture_output=True, text=True, env=env).stdout.strip():
            time.sleep(0.5)
        for daemon in [*(f"slurmd-{name}" for name in names), "slurmctld", "munged"]:
            pid_file = root / f"{daemon}.pid"
            if pid_file.is_file():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)


def task_processes(run) -> dict:
    """{global rank: process} of the python ranks training run folder `run` under srun (srun and
    the batch shell name the run too; data-loader workers are the ranks' children)."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            cmd = proc.info["cmdline"] or []
            if any(a.endswith("pretrain.py") for a in cmd[:2]) and str(run) in cmd \
                    and "RANK" in proc.environ() and "pretrain.py" not in \
                    " ".join(proc.parent().cmdline()):
                found[int(proc.environ()["RANK"])] = proc
    return found
