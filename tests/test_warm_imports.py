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
    assert out.stdout.strip() == "ok"
