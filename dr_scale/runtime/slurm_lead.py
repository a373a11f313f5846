"""How long before its end a SLURM job must be told to stop (sbatch --signal=USR1@<lead>): long
enough to finish the step under way, save, and have the ranks agree the save is complete. The
estimate: the checkpoint's bytes (weights in the training precision, fp32 master weights and two
Adam moments: 12 bytes a parameter more), each node writing its ranks' share at
train.checkpoint_write_gbps; the lead asked is twice that (a step and an evaluation may run
first) plus a minute. The script says what it gave in DR_SCALE_SIGNAL_LEAD_S
(launchers/slurm_pretrain.sbatch)."""
import math
import os
from typing import Iterator

LEAD_ENV = "DR_SCALE_SIGNAL_LEAD_S"


def checkpoint_bytes(parameters: int, weight_bytes: int) -> int:
    return parameters * (weight_bytes + 12)


def lead_lines(parameters: int, weight_bytes: int, nodes: int, write_gbps: float,
               environ=os.environ) -> Iterator[str]:
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
    if given and given.isdigit() and int(given) < lead:
        yield (f"warning: the job's stop signal comes {given} s before its end, a save needs "
               f"~{lead} s: the time limit may end it mid-save (the run then resumes from the "
               f"checkpoint before); raise --signal=USR1@ and {LEAD_ENV} to {lead}")
