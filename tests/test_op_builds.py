"""A build lock left in torch's extension folder (a killed JIT build of a DeepSpeed op) is named
at start: DeepSpeed would otherwise wait on it forever without a word."""
import os
import time

from tests.conftest import launch

from dr_scale.runtime import op_builds


def left_lock(root, minutes):
    lock = root / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    (root / "py311_cpu" / "async_io").mkdir()  # built, no lock: nothing to say
    then = time.time() - minutes * 60
    os.utime(lock, (then, then))
    return lock


def test_a_left_lock_is_named_with_its_age(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_builds.lock_warnings() == []
    lock = left_lock(tmp_path, 40)
    assert op_builds.lock_warnings() == [
        f"{lock} is 40 min old: a build of the `cpu_adam` op holds it, or a killed one left it; "
        "DeepSpeed waits, silently, until it is gone: delete it if no build is running"]


def test_the_launcher_says_it_before_anything_else(tmp_path, cache_dir, monkeypatch):
    """The launcher's first line, before the config's own error stops it (nothing is built)."""
    lock = left_lock(tmp_path / "ext", 7)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    proc = launch(["--run_dir", tmp_path / "run", "--ds_config", "zero3",
                   "train.micro_batch_size=3", "train.global_batch_size=8"], 1, cache_dir,
                  launcher="python", check=False, timeout=120)
    said = [l for l in proc.stderr.splitlines() if l.startswith("dr_scale:")]
    assert proc.returncode == 2 and len(said) == 2, proc.stderr
    assert said[0] == f"dr_scale: warning: {lock} is 7 min old: a build of the `cpu_adam` op " \
                      "holds it, or a killed one left it; DeepSpeed waits, silently, until it " \
                      "is gone: delete it if no build is running"
    assert said[1].startswith("dr_scale: error: train.global_batch_size=8 is not a multiple")
    assert lock.exists() and not (tmp_path / "run").exists()
