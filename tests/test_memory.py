"""MemoryMonitor (sample, plot, memory.png per run) and MemoryAlertCallback."""
import json
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch

from dr_scale.callbacks.memory import MemoryMonitor, parse_threshold
from dr_scale.errors import DrScaleError
from tests.conftest import launch


def test_parse_threshold():
    assert parse_threshold("12GiB") == 12 * 2**30
    assert parse_threshold("500 MB") == 500_000_000
    assert parse_threshold(1234) == 1234
    assert parse_threshold("50%") == pytest.approx(psutil.virtual_memory().total / 2, rel=1e-6)
    for bad in ("80 parsecs", "0%", "150%", -5, True, "abc"):
        with pytest.raises(DrScaleError, match="max_usage: expected a percentage"):
            parse_threshold(bad)


def test_monitor_samples_and_plots(tmp_path):
    import matplotlib.image

    mon = MemoryMonitor()
    blob = []
    for step in range(4):
        # 64 MiB a step, pages touched: above glibc's largest mmap threshold (32 MiB), so each is
        # a fresh mapping rather than heap an earlier test freed (which RSS already counts)
        blob.append(np.ones(64 * 2**20, dtype=np.uint8))
        rec = mon.sample(step)
        assert rec["host_rss_bytes"] > 0
    rss = [s["host_rss_bytes"] for s in mon.samples]
    assert rss[-1] - rss[0] >= 50 * 2**20
    img = matplotlib.image.imread(mon.plot(tmp_path / "m.png"))
    assert img.shape[0] > 100 and img.shape[1] > 100
    # What is drawn: one line per rank, the samples in MiB against their steps.
    fig = mon.figure({0: mon.samples, 1: mon.samples[:2]})
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [l.get_label() for l in lines] == ["rank 0", "rank 1"]
    assert list(lines[0].get_xdata()) == [0, 1, 2, 3]
    assert list(lines[0].get_ydata()) == [r / 2**20 for r in rss]
    assert list(lines[1].get_ydata()) == [r / 2**20 for r in rss[:2]]


def test_monitor_and_alert_in_a_run(cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero2", "--run_dir", run, "data.seq_length=64",
                   "train.max_steps=6", "train.log_interval=2", "train.eval_interval=6",
                   "train.save_interval=6", "train.eval_samples=8", "logging.plot=false",
                   "callbacks={memory_monitor: {enabled: true}, "
                   "memory_alert: {enabled: true, max_usage: 1MiB, every: 2}}"], 2, cache_dir)
    import matplotlib.image

    img = matplotlib.image.imread(run / "memory.png")  # decodes as a PNG
    assert img.shape[0] > 100
    # Use is far above 1 MiB: warned at step 1, then every 2 steps, on each rank.
    assert proc.stderr.count("memory alert (rank 0") == 3
    events = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()
              if "memory_alert" in l]
    assert [e["step"] for e in events] == [1, 3, 5]
    assert all(e["usage_bytes"] > e["threshold_bytes"] == 2**20 for e in events)


def test_bad_alert_threshold_is_one_line(cache_dir, tmp_path):
    from tests.test_cli_errors import errors_of

    proc = launch(["--ds_config", "zero1", "--run_dir", tmp_path / "r",
                   "callbacks={memory_alert: {enabled: true, max_usage: lots}}"], 1, cache_dir,
                  launcher="python", check=False)
    assert "callbacks.memory_alert.max_usage: expected a percentage ('80%'), a size ('12GiB') " \
           "or bytes, got 'lots'" in errors_of(proc)


def test_release_freed_gives_the_heaps_free_pages_back():
    """train.release_host_memory's call: 16 MiB tensors (glibc's heap, once a larger block was
    freed) stay resident after they are freed between live ones; released, they leave."""
    from dr_scale.runtime import host_memory

    assert host_memory.can_release()  # the CI machines run glibc
    rss = lambda: psutil.Process().memory_info().rss
    big = torch.ones(5 * 2**20)
    del big  # a 20 MiB block freed: glibc raises its mmap threshold to it (up to 32 MiB)
    blocks = [torch.ones(4 * 2**20) for _ in range(32)]  # 32 x 16 MiB, pages touched
    del blocks[::2]  # 16 of them freed, each between two live ones: nothing to coalesce
    kept = rss()
    assert host_memory.release_freed() is True
    given_back = kept - rss()
    assert given_back > 200 * 2**20, given_back / 2**20  # of the 256 MiB freed
    assert all(float(b[-1]) == 1.0 for b in blocks)  # the live ones untouched


FREE_HALF = """
import sys, psutil, torch
from dr_scale.runtime import host_memory
if sys.argv[1] == "fixed":
    assert host_memory.give_large_blocks_pages_of_their_own()
rss = lambda: psutil.Process().memory_info().rss
big = torch.ones(5 * 2**20)
del big  # a 20 MiB block freed: glibc raises its mmap threshold to it, unless it was fixed
blocks = [torch.ones(4 * 2**20) for _ in range(32)]  # 32 x 16 MiB, pages touched
before = rss()
del blocks[::2]  # 16 of them freed, each between two live ones
print((before - rss()) / 2**20)
"""


def test_large_tensors_get_pages_of_their_own():
    """train.release_host_memory also fixes glibc's mmap threshold before the build: 16 MiB
    tensors freed between live ones leave at once (256 MiB freed, > 200 MiB given back), where
    the default threshold, raised by a larger freed block, keeps them (< 50 MiB given back);
    each in a fresh interpreter, since the threshold is the process's."""
    given_back = {how: float(subprocess.run([sys.executable, "-c", FREE_HALF, how],
                                             capture_output=True, text=True, check=True).stdout)
                  for how in ("default", "fixed")}
    assert given_back["fixed"] > 200 and given_back["default"] < 50, given_back


REALLOCATE = """
import resource, sys, torch
from dr_scale.runtime import host_memory
if sys.argv[1] == "kept":
    assert host_memory.keep_freed_blocks_for_reuse()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for step in range(6):  # a step's large tensors (logits, an fp32 copy, a gradient): made, freed
    before = faults()
    tensors = [torch.ones(n * 2**20) for n in (16, 32, 12)]  # 64, 128, 48 MiB: above 32 MiB
    del tensors
    counts.append(faults() - before)
print(sum(counts[1:]))  # the steps after the first
"""


def test_a_cpu_rank_reuses_the_pages_of_the_last_steps_tensors():
    """The default on CPU ranks (host_memory.keep_freed_blocks_for_reuse): tensors above glibc's
    largest mmap threshold, made again after they were freed, land in part on pages already
    faulted in. glibc's default maps them anew each time (5 steps x 240 MiB = 307,200 4-KiB
    pages); kept, under half of that is faulted (131,072 measured, glibc 2.36: torch asks for
    64-byte aligned blocks, and a freed block is then just too small for the next request of its
    own size until it has merged with a neighbour). Each in a fresh interpreter, since mallopt's
    settings are the process's."""
    faults = {how: int(subprocess.run([sys.executable, "-c", REALLOCATE, how],
                                      capture_output=True, text=True, check=True).stdout)
              for how in ("default", "kept")}
    assert faults["default"] > 300_000 and faults["kept"] < 0.5 * faults["default"], faults


PEAK_AT_RESET = """
import torch
from dr_scale.train.metrics import peak_memory_bytes, reset_peak_memory
startup = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
del startup
before = peak_memory_bytes("cpu")
reset_peak_memory("cpu")
after = peak_memory_bytes("cpu")
training = torch.ones(16 * 2 ** 20 // 4)
print(before - after, peak_memory_bytes("cpu") - after)
"""


def test_peak_memory_starts_anew_at_reset():
    """mem_peak_bytes is the training's peak: the trainer resets the high-water mark before its
    first step, so a start-up buffer (the peak-FLOPs matmuls, the kernel choice) freed by then
    is not counted (CPU: VmHWM, reset through /proc/self/clear_refs), and what comes after is.
    In a fresh interpreter: in the test worker, a later allocation can be served from freed heap
    pages an earlier test left resident, and the peak rightly does not move."""
    dropped, grown = map(int, subprocess.run([sys.executable, "-c", PEAK_AT_RESET],
                                             capture_output=True, text=True,
                                             check=True).stdout.split())
    assert dropped >= 48 * 2 ** 20 and grown >= 15 * 2 ** 20, (dropped, grown)
