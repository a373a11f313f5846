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


def test_gpu_check_stops_at_once_without_a_gpu(tmp_path):
    """benchmarks/gpu_check.sh where no CUDA GPU is visible: one line, exit 2, before installing or
    running anything (a CPU torch must not pass it by skipping the GPU tests)."""
    import os
    import sys

    # the GPUs hidden, so the same holds on a GPU machine
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT,
                          env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
                                   CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU visible to ")
    assert lines[0].endswith("this check needs a GPU machine")
    assert list(tmp_path.iterdir()) == []  # nothing installed or written
