"""Hangs become errors. The process group is started with `train.collective_timeout_s`; a
collective that waits longer raises in torch (gloo: "Timed out waiting 15000ms for recv
operation", a dead peer: "Connection closed by peer"). The trainer names what it is doing
(`doing("step 12 forward")`), and the launcher turns such an error into one line naming this
rank and that phase instead of a traceback, or instead of the silent wait of the default
timeout. (NCCL's watchdog aborts the process itself on a timeout and logs its own message.)
"""
import contextlib
from typing import Optional

from dr_scale.errors import DrScaleError

# torch's messages for a collective that waited too long, or whose peer is gone
MARKERS = ("Timed out waiting", "timed out", "Connection closed by peer",
           "Connection reset by peer", "Broken pipe")
_state = {"doing": "start-up", "timeout_s": None, "collective": "none yet"}


def configure(timeout_s: int):
    _state["timeout_s"] = timeout_s


def now(what: str):
    """What this rank does from here on (the phases below refine it while they run)."""
    _state["doing"] = what


@contextlib.contextmanager
def doing(what: str):
    before, _state["doing"] = _state["doing"], what
    yield
    _state["doing"] = before  # not when an error leaves: the launcher names where it happened


def activity() -> str:
    return _state["doing"]


def entering(collective: str):
    """Which of dr_scale's own collectives this rank entered last (runtime/comm.py): what its
    heartbeat reports (runtime/watchdog.py)."""
    _state["collective"] = f"{collective} during {_state['doing']}"


def last_collective() -> str:
    return _state["collective"]


def as_error(exc: BaseException, rank: int) -> Optional[DrScaleError]:
    """The one-line error for a collective that timed out or lost its peer, or for a rendezvous
    that could not listen or connect (a port taken, an address unreachable); None for others."""
    text = str(exc).strip()
    if type(exc).__name__ == "DistNetworkError":  # torch.distributed's; a RuntimeError
        detail = text.splitlines()[-1].split("] ", 1)[-1][:200]
        return DrScaleError(f"rank {rank}: the process group could not start during "
                            f"{activity()}: {detail} (MASTER_ADDR/MASTER_PORT)")
    if not isinstance(exc, RuntimeError) or not any(m in text for m in MARKERS):
        return None
    detail = text.splitlines()[-1].split("] ", 1)[-1][:160]
    limit = _state["timeout_s"]
    return DrScaleError(
        f"rank {rank}: a collective failed during {activity()}: {detail} "
        f"(train.collective_timeout_s={limit}); another rank stopped responding or died")
