"""The installed package: dr_scale.kernels comes from the top-level kernels/ folder, and the
console script is on PATH."""
import shutil
import subprocess
from pathlib import Path

from tests.conftest import ROOT


def test_kernels_folder_is_dr_scale_kernels():
    import dr_scale.kernels
    from dr_scale.kernels import reference

    assert Path(dr_scale.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert callable(reference.rms_norm)


def test_console_script_installed():
    exe = shutil.which("dr-scale")
    assert exe, "dr-scale is not on PATH; install with pip install -e ."
    out = subprocess.run([exe, "presets"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "llama_7b" in out.stdout and "6738.4M" in out.stdout
