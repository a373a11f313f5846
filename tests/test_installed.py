"""Installed like a library: `pip install .` (not editable) into a fresh virtual environment, then
from another directory the console script and the documented launch form
(`deepspeed --module dr_scale.launch`) find the bundled DeepSpeed configs by bare name."""
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, run_group, module_folder


@pytest.fixture(scope="module")
def venv(request, tmp_path_factory):
    """A venv that sees this interpreter's packages, torch and deepspeed (installing them again
    would fetch gigabytes), but has its own, non-editable copy of dr_scale. The running
    interpreter is often a venv itself, whose `--system-site-packages` would be the base
    interpreter's (without torch): the running one's site-packages are named in a .pth file,
    after the new venv's own."""
    path = module_folder(request, tmp_path_factory, "venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / "bin" / "python"
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(own) / "running_interpreter.pth").write_text("\n".join(parents) + "\n")
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps",
                           "--quiet", str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_installed_copy_is_used_outside_the_checkout(venv, tmp_path):
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import dr_scale, dr_scale.kernels; print(dr_scale.__file__); "
                          "print(dr_scale.kernels.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(str(venv) in f and str(ROOT) not in f for f in out), out


def test_installed_copy_carries_the_cuda_sources(venv, tmp_path):
    """The fused kernels build from source on first use: every source the build names, and the
    headers they include, are installed beside it, byte for byte."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import pathlib, dr_scale.kernels.cuda as c; "
                          "print(pathlib.Path(c.__file__).parent)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    installed = Path(out.stdout.strip())
    assert str(venv) in str(installed)
    sources = sorted(p.name for p in (ROOT / "kernels" / "cuda").iterdir()
                     if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert {"binding.cpp", "norms.cu", "common.cuh", "dr_kernels.h"} <= set(sources)
    for name in sources:
        assert (installed / name).read_bytes() == (ROOT / "kernels" / "cuda" / name).read_bytes()


def test_console_script_from_another_directory(venv, tmp_path):
    exe = venv / "bin" / "dr-scale"
    out = subprocess.run([str(exe), "presets"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and "llama_7b" in out.stdout, out.stderr
    out = subprocess.run([str(exe), "estimate", "--ds_config", "zero3", "--ranks", "8",
                          "model.preset=llama_7b", "--json"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    est = json.loads(out.stdout)
    assert est["ds_config"].startswith(str(venv)) and est["ds_config"].endswith("zero3.json")
    assert est["bytes_per_rank"]["total"] > 2e9


def test_launch_of_the_installed_module(venv, tmp_path, cache_dir):
    env = dict(os.environ, DR_SCALE_CACHE=str(cache_dir), OMP_NUM_THREADS="1")
    # `deepspeed ...` under the venv's interpreter (the venv borrows deepspeed from the running
    # interpreter, so it has no script of its own): the launcher starts its ranks with it.
    cmd = [str(venv / "bin" / "python"), "-m", "deepspeed.launcher.runner",
           "--master_port", str(free_port()), "--module",
           "dr_scale.launch", "--ds_config", "zero1", "--run_dir", str(tmp_path / "run"),
           "data.seq_length=64", "train.max_steps=2", "train.eval_samples=8",
           "logging.plot=false", "logging.tensorboard=false"]
    code, out, err = run_group(cmd, env, timeout=300, cwd=tmp_path)  # not the checkout
    assert code == 0, (out + err)[-3000:]
    assert f"run folder {tmp_path / 'run'}" in out
    snapshot = json.loads((tmp_path / "run" / "run.json").read_text())
    assert snapshot["world"]["world_size"] == 1
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["step"] == 2
