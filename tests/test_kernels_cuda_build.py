"""Every CUDA kernel source compiles with nvcc for sm_80 (A100) and sm_90 (H100/H200), and the
torch binding compiles against the installed torch headers: checked here, on machines without a
GPU; running them is tests/test_kernels_gpu.py's job."""
import shutil
import subprocess
import sysconfig

import pytest

from tests.conftest import ROOT

CUDA_DIR = ROOT / "kernels" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))


def nvcc():
    path = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    assert shutil.which(path), "nvcc not found: CI compile-checks the CUDA kernels with it"
    return path


def test_all_sources_are_listed_for_the_extension_build():
    from dr_scale.kernels import cuda

    assert sorted(s for s in cuda.SOURCES if s.endswith(".cu")) == [p.name for p in SOURCES]
    assert len(SOURCES) == 3


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cu_files_compile(arch, tmp_path):
    procs = [subprocess.Popen([nvcc(), "-c", "-std=c++17", f"-arch={arch}", "-Werror",
                               "all-warnings", str(src), "-o", str(tmp_path / f"{src.stem}.o")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for src in SOURCES]
    for src, p in zip(SOURCES, procs):
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{src.name} ({arch}):\n{out}"
        assert (tmp_path / f"{src.stem}.o").stat().st_size > 10_000


def test_torch_binding_compiles(tmp_path):
    from torch.utils.cpp_extension import include_paths

    cuda_include = "/usr/local/cuda/include"
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=dr_scale_cuda",
           f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", f"-I{CUDA_DIR}",
           *[f"-I{p}" for p in include_paths()], str(CUDA_DIR / "binding.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
