"""Modules the DeepSpeed engine imports on its first use, imported in a thread while the run does
work that leaves the interpreter free: waiting for the other ranks, reading the data's index,
drawing the initial values (torch's generators release the GIL).

Why: torch's Optimizer and DeepSpeed's ZeRO optimizers ask torch._dynamo whether they are being
compiled, and its first import pulls in inductor and sympy (~880 modules): 2.3 s of a 1-rank
start-up of 11.7 s on this project's CPU machines (py-spy), spent on the main thread after the
build, with nothing beside it. DeepSpeed's ZeRO check then imports its Muon optimizer, whose
`torch.compile` decorators pull in inductor's compile_fx and dynamo's repro tools: another 1.5 s
on the main thread (py-spy, AMD EPYC, llama_1b cut to 8 layers). Python's per-module import locks make a concurrent import safe: a
thread that needs a module another thread is importing waits for it.
"""
import threading
from typing import Optional

from dr_scale.runtime.gil import short_switch_interval

WARMED = ("torch._dynamo",
          "deepspeed.runtime.zero.muon.muon_optimizer")  # is_zero_supported_optimizer's

_thread: Optional[threading.Thread] = None


def start() -> None:
    """Begin importing WARMED in a daemon thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_import_all, name="dr_scale warm imports", daemon=True)
        _thread.start()


def finish() -> None:
    """Wait for the imports begun by `start` (before the engine that uses them)."""
    if _thread is not None:
        _thread.join()


def _import_all():
    import importlib

    with short_switch_interval():  # the main thread's short calls get the GIL back at once
        for name in WARMED:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the engine's own import reports it where it
                pass           # matters
