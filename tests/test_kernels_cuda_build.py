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


def test_each_machine_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Local rank 0 of every node builds the extension: nodes sharing $HOME (the extension cache
    under it) each get a folder of their own, so they never race on one lock and objects."""
    import socket

    from dr_scale.kernels import cuda

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cuda.build_directory()
    assert here.parent.parent == tmp_path and here.name == socket.gethostname()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-2")
    assert cuda.build_directory() == here.parent / "node-2"


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


# -- built once per node (kernels/cuda/build.py), checked with a build step that writes a file ----
def _slow_build(rank, count_file, fail=False):
    """A build that takes a moment and leaves a trace of each time it ran: rank, start, end."""
    import time

    start = time.time()
    time.sleep(0.5)
    with open(count_file, "a") as f:
        f.write(f"{rank} {start} {time.time()}\n")
    if fail:
        raise RuntimeError("Error building extension 'dr_scale_cuda': [1/4] nvcc ...\n"
                           "norms.cu(12): error: identifier \"x\" is undefined\nninja: stopped")
    return "module"


def _rank(local_rank, build_dir, count_file, fail, out):
    import functools
    import json
    from pathlib import Path

    from dr_scale.kernels.cuda import build

    try:
        result = build.build_once(functools.partial(
            _slow_build, local_rank, count_file, fail and local_rank == 0), Path(build_dir),
            [CUDA_DIR / "norms.cu"], local_rank, timeout_s=20)
    except build.BuildFailed as e:
        result = f"failed: {e}"
    Path(f"{out}.{local_rank}").write_text(json.dumps(result))


def _run_node(tmp_path, fail=False):
    import json
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # children share this process as parent: one job
    count = tmp_path / "count"
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "ext"), str(count), fail,
                                              str(tmp_path / "out"))) for r in (1, 2, 0)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1, 2)]
    runs = {int(r): (float(a), float(b)) for r, a, b in
            (line.split() for line in count.read_text().splitlines())}
    return results, runs


def test_local_rank_zero_builds_and_the_others_load_after_it(tmp_path):
    results, runs = _run_node(tmp_path)
    assert results == ["module"] * 3
    # ranks 1 and 2 (started first) called build only after rank 0's had finished: for them it
    # is a load of what exists (torch's load does not rebuild unchanged sources)
    assert sorted(runs) == [0, 1, 2]
    assert min(runs[1][0], runs[2][0]) >= runs[0][1]


def test_a_failed_build_reaches_every_rank_as_one_line_with_the_compiler_error(tmp_path):
    results, runs = _run_node(tmp_path, fail=True)
    assert list(runs) == [0]  # the others did not try again
    log = tmp_path / "ext" / "dr_scale_build.log"
    want = (f'failed: the CUDA extension did not build: norms.cu(12): error: identifier "x" is '
            f"undefined (full log: {log})")
    assert results == [want] * 3
    assert "ninja: stopped" in log.read_text()


def test_a_stale_lock_is_named_and_removed(tmp_path):
    import json
    import subprocess
    import sys

    from dr_scale.kernels.cuda import build

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "lock").write_text("")
    (ext / "dr_scale_builder.json").write_text(json.dumps(
        {"host": __import__("socket").gethostname(), "pid": dead.pid, "started": 0}))
    said = []
    assert build.build_once(lambda: "module", ext, [CUDA_DIR / "norms.cu"], 0, timeout_s=5,
                            say=said.append) == "module"
    assert said == [f"dr_scale: removed a stale CUDA build lock {ext / 'lock'} (left by pid "
                    f"{dead.pid}, which is no longer running)"]
    assert not (ext / "lock").exists()


def test_a_rank_waiting_on_a_dead_builder_says_what_it_waits_for(tmp_path):
    from dr_scale.kernels.cuda import build

    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "lock").write_text("")
    with pytest.raises(build.BuildFailed, match=r"^waited 1 s for local rank 0 to build the CUDA "
                                                r"extension in .*ext \(lock .*lock held, \d+ s "
                                                r"old, by no recorded build\); raise "
                                                r"DR_SCALE_CUDA_BUILD_TIMEOUT"):
        build.build_once(lambda: "module", ext, [CUDA_DIR / "norms.cu"], 1, timeout_s=1)
