"""The engine's imports made in a thread at start-up (runtime/warm_imports.py): in a fresh
interpreter, the modules are imported by `finish`, and the GIL switch interval lowered for the
import is restored."""
import subprocess
import sys

CHECK = """
import sys
from dr_scale.runtime import warm_imports
assert "torch._dynamo" not in sys.modules
interval = sys.getswitchinterval()
warm_imports.start()
warm_imports.finish()
assert all(name in sys.modules for name in warm_imports.WARMED), warm_imports.WARMED
assert sys.getswitchinterval() == interval, sys.getswitchinterval()
print("ok")
"""


def test_warm_imports_import_in_a_thread_and_restore_the_switch_interval():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"  # DeepSpeed's import logs to stdout


def test_overlapping_short_switch_intervals_restore_the_original():
    """The import thread and the drawing threads shorten the interval at once: whichever ends
    last restores it (the interval is the interpreter's)."""
    from dr_scale.runtime.gil import SHORT_S, short_switch_interval

    original = sys.getswitchinterval()
    first, second = short_switch_interval(), short_switch_interval()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first user ends before the second
    assert abs(sys.getswitchinterval() - SHORT_S) < 1e-9  # kept in microseconds
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == original
