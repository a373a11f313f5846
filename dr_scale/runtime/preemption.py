"""Stop signals (SIGTERM, SIGUSR1: what SLURM and other schedulers send before they preempt or
hit a time limit): a handler only notes the signal; at the next step boundary all ranks agree
(one small all-reduce) to stop, save a checkpoint and exit with EXIT_PREEMPTED, so the same
command with `--resume auto` continues the run.
"""
import signal
import threading
from typing import Optional, Tuple

import torch

from dr_scale.runtime import comm

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame):
        self.received = signum  # nothing else here: the rank may be inside a collective

    def agreed(self, idle_here: bool = True, save_due_here: bool = False
               ) -> Tuple[Optional[str], bool, bool]:
        """On every rank: the name of a stop signal any rank has received (else None), whether
        `idle_here` holds on all ranks (no asynchronous checkpoint write left: the trainer
        reports a finished save on every rank at the same step), and whether a save is due on
        any rank (by its clock: train.save_interval_minutes), so all save at one step. One
        all-reduce."""
        flags = torch.tensor([self.received or 0, -int(idle_here), int(save_due_here)],
                             dtype=torch.int64)
        comm.all_reduce(flags, "max")  # max of the negated flag: its minimum over the ranks
        code = int(flags[0].item())
        return (signal.Signals(code).name if code else None), bool(-flags[1].item()), \
            bool(flags[2].item())

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
