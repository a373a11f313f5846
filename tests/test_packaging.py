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


def test_the_bare_name_kernels_stays_pypis_from_the_checkout_root(tmp_path):
    """Code run from the checkout's root finds its kernels/ folder as a bare `kernels` (the
    working directory comes first on sys.path), where PyPI's `kernels` (Hugging Face's hub
    kernels, required and imported by transformers >= 5.25) belongs: the folder hands the name
    over, submodules included, and stays `dr_scale.kernels` itself; transformers' hub-kernel
    integration imports from there (it failed with "cannot import name 'CUDAProperties' from
    'kernels'" before)."""
    import os
    import sys

    site = tmp_path / "site" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("WHO = 'pypi'\nfrom kernels.layer import LAYER\n")
    (site / "layer.py").write_text("LAYER = 'a submodule of it'\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    probe = ("import kernels, dr_scale.kernels as ours; "
             "print(kernels.WHO, '|', kernels.LAYER, '|', ours.__name__, ours.reference.__name__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "pypi | a submodule of it | dr_scale.kernels dr_scale.kernels.reference"
    hub = subprocess.run([sys.executable, "-c", "import transformers.integrations.hub_kernels"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert hub.returncode == 0, hub.stderr[-2000:]


def test_gpu_check_plan_fits_its_budget_and_runs_every_gpu_test():
    """`gpu_check.sh --plan`: the default (quick) check's budgets sum to at most 360 s of the 600
    a GPU command gets (a machine took 30-100 s to start in the first GPU run), --full's to 480;
    each budget says whether it was measured or estimated, and from what; the run's own path
    comes first (prepare, launch); every file it lists collects tests, every test file that needs
    a GPU is listed, and what it deselects as CPU-only exists and is marked to skip on a GPU."""
    import re
    import sys

    plan = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--plan"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    parts = re.findall(r"^part (\w+): budget (\d+) s \((measured|estimated): (.+)\)$", plan, re.M)
    budgets = {p: int(s) for p, s, _, _ in parts}
    assert list(budgets) == ["prepare", "launch", "tests", "kernels", "llama_1b"]
    assert all(len(basis) > 10 for *_, basis in parts)
    quick = re.search(r"^default \(quick\): ([\w ]+): (\d+) s$", plan, re.M)
    assert quick.group(1).split() == ["prepare", "launch", "tests"]
    assert int(quick.group(2)) == sum(budgets[p] for p in quick.group(1).split()) <= 360
    full = re.search(r"^--full: ([\w ]+): (\d+) s$", plan, re.M)
    assert full.group(1).split() == list(budgets) and int(full.group(2)) == sum(budgets.values())
    assert sum(budgets.values()) <= 480
    listed = re.findall(r"^tests runs: (\S+)$", plan, re.M)
    deselected = re.findall(r"^tests deselects \(CPU-only\): (\S+)$", plan, re.M)
    marked = re.compile(r"^(pytestmark = |@)pytest\.mark\.skipif\(not torch\.cuda\.is_available",
                        re.M)
    needs_gpu = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                       if marked.search(p.read_text()))
    assert needs_gpu and set(needs_gpu) <= set(listed)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                "-p", "no:cacheprovider", *listed], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout.splitlines()
    for entry in listed:  # a file, or one test of a file
        assert any(line.startswith(entry if "::" in entry else entry + "::")
                   for line in collected), entry
    assert len(deselected) == 2
    for node in deselected:
        assert node in collected
        file, name = node.split("::")
        source = (ROOT / file).read_text()
        before = source[:source.index(f"def {name}(")].rstrip().splitlines()[-1]
        assert before.startswith("@pytest.mark.skipif(torch.cuda.is_available()"), node


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
