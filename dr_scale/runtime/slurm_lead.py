"""How long before its end a SLURM job must be told to stop (sbatch --signal=USR1@<lead>): long
enough to finish the step under way, save, and have the ranks agree the save is complete. The
estimate: the checkpoint's bytes (weights in the training precision, fp32 master weights and two
Adam moments: 12 bytes a parameter more), each node writing its ranks' share at
train.checkpoint_write_gbps; the lead asked is twice that (a step and an evaluation may run
first) plus a minute. The script says what it gave in DR_SCALE_SIGNAL_LEAD_S
(launchers/slurm_pretrain.sbatch)."""
import math
import os
import re
import subprocess
from typing import Iterator, Optional

LEAD_ENV = "DR_SCALE_SIGNAL_LEAD_S"


def checkpoint_bytes(parameters: int, weight_bytes: int) -> int:
    return parameters * (weight_bytes + 12)


def grace_time_s(environ=os.environ) -> Optional[int]:
    """The GraceTime of the job's partition (how long a preemption's SIGTERM comes before its
    SIGKILL), from `scontrol show partition`; None where SLURM does not say."""
    partition = environ.get("SLURM_JOB_PARTITION")
    if not partition:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "partition", partition, "-o"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_grace(out)


def parse_grace(text: str) -> Optional[int]:
    """Seconds of `GraceTime=` in scontrol's line (seconds, or [D-]HH:MM:SS), or None (none
    given, or a partition whose jobs are never preempted: PreemptMode=OFF)."""
    found = re.search(r"\bGraceTime=(\S+)", text)
    if not found or re.search(r"\bPreemptMode=OFF\b", text):
        return None
    value = found.group(1)
    if value.isdigit():
        return int(value)
    days, _, clock = value.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


def lead_lines(parameters: int, weight_bytes: int, nodes: int, write_gbps: float,
               environ=os.environ, grace_s: Optional[int] = None) -> Iterator[str]:
    """The start lines of a run under SLURM (none elsewhere): the save estimate and lead, and a
    warning when the job's lead is shorter."""
    if "SLURM_JOB_ID" not in environ:
        return
    total = checkpoint_bytes(parameters, weight_bytes)
    save_s = total / max(1, nodes) / (write_gbps * 1e9)
    lead = 60 * math.ceil((2 * save_s + 60) / 60)
    given = environ.get(LEAD_ENV)
    yield (f"slurm: job {environ['SLURM_JOB_ID']}; a save writes {total / 1e9:.1f} GB, "
           f"{total / max(1, nodes) / 1e9:.1f} GB a node: ~{save_s:.0f} s at "
           f"{write_gbps:g} GB/s a node (train.checkpoint_write_gbps); stop signal lead needed "
           f"{lead} s (--signal=USR1@{lead}), given "
           f"{given + ' s' if given else 'unknown (' + LEAD_ENV + ' unset)'}")
    if grace_s is not None and grace_s < save_s:
        yield (f"warning: a preemption gives {grace_s} s (GraceTime of partition "
               f"{environ.get('SLURM_JOB_PARTITION')}) from its SIGTERM to its SIGKILL, a save "
               f"needs ~{save_s:.0f} s: a preemption loses the work since the last save "
               f"(train.save_interval_minutes bounds it)")
    if given and given.isdigit() and int(given) < lead:
        yield (f"warning: the job's stop signal comes {given} s before its end, a save needs "
               f"~{lead} s: the time limit may end it mid-save (the run then resumes from the "
               f"checkpoint before); raise --signal=USR1@ and {LEAD_ENV} to {lead}")
