"""A short GIL switch interval while threads of ours overlap work that leaves the GIL often.

The start-up's overlapped work (the initial values drawn by a rank's threads, the engine's
imports in a thread of their own) is made of short calls that release the GIL (a block of
65,536 values takes ~0.2-0.4 ms). At Python's default 5 ms switch interval a thread waits up to
5 ms to get the GIL back after each, and the overlap is lost (measured: two drawing threads, or
the import thread beside the draw, gained nothing). 0.1 ms hands it back at once.

The interval is the interpreter's, so users that overlap (the import thread and the drawing
threads run at once) share one count: the first lowers it, the last restores it.
"""
import contextlib
import sys
import threading

SHORT_S = 1e-4

_lock = threading.Lock()
_users = 0
_saved = None


@contextlib.contextmanager
def short_switch_interval():
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(SHORT_S)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_saved)
