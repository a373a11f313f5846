"""MFU's denominator: datasheet peaks by exact GPU part; on CPU a peak measured at the model's
largest GEMM, cached per machine; an impossible MFU re-measures, and is never printed."""
import json
import re
import shutil

import pytest
import torch

from dr_scale.train import peak_flops as pf
from tests.conftest import launch, launched_threads
from tests.test_train_distributed import records

TFLOPS = 1e12


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", 989, 67),        # SXM
    ("NVIDIA H100 PCIe", 756, 51),             # not the SXM figure
    ("NVIDIA H100 NVL", 835, 60),
    ("NVIDIA H200", 989, 67),
    ("NVIDIA GH200 480GB", 989, 67),           # Grace Hopper: not H200's bandwidth
    ("NVIDIA H800", 989, 67),
    ("NVIDIA H20", 148, 44),                   # not H200's
    ("NVIDIA A100-SXM4-80GB", 312, 19.5),
    ("NVIDIA A100 80GB PCIe", 312, 19.5),
    ("NVIDIA A10", 125, 31.2),                 # not A100's
    ("NVIDIA L40S", 362, 91.6),
    ("NVIDIA L4", 121, 30.3),                  # not L40's
    ("NVIDIA B200", 2250, None),
    ("NVIDIA GB200", 2500, None),              # not B200's
    ("NVIDIA A10G", None, None),               # no datasheet: measured
    ("NVIDIA RTX 6000 Ada Generation", None, None),
])
def test_datasheet_peak_by_exact_part(name, bf16, fp32):
    for precision, want in (("bf16", bf16), ("fp16", bf16), ("fp32", fp32)):
        got = pf.datasheet_peak(name, precision)
        assert got == (want * TFLOPS if want else None), (name, precision)


def test_bandwidth_by_exact_part():
    """The fused kernels' targets are shares of this figure: GH200's name holds H200's."""
    assert pf.datasheet_bandwidth("NVIDIA GH200 480GB") == 4.0e12
    assert pf.datasheet_bandwidth("NVIDIA H200") == 4.8e12
    assert pf.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12


def test_cpu_peak_is_measured_at_the_gemm_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    gemm = (256, 128, 512)
    first = pf.peak_flops("fp32", torch.device("cpu"), gemm)
    assert first.measured and first.value > 1e8
    assert first.source == "measured fp32 matmul 256x128x512, best of 5"
    cache = json.loads((tmp_path / "cpu_peaks.json").read_text())
    (key,) = cache
    assert key.endswith(f"{torch.get_num_threads()} threads | fp32 | 256x128x512")
    again = pf.peak_flops("fp32", torch.device("cpu"), gemm)
    assert again.value == first.value and "cached in" in again.source
    (tmp_path / "cpu_peaks.json").write_text("{not json")  # damaged: measured again
    assert "best of 5" in pf.peak_flops("fp32", torch.device("cpu"), gemm).source


def test_impossible_utilisation_remeasures_then_gives_up(tmp_path, monkeypatch):
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    gemm = (256, 128, 512)
    real = pf.measure_matmul(*gemm, "fp32")
    # A peak measured while another process had the cores: 1000x too low. A step that achieved
    # 5% of the real peak reads as 5000%; measuring again makes it possible.
    low = pf.Peak(real / 1000, "measured", "fp32", gemm)
    assert low.check(0.05 * real / low.value) and low.remeasured and not low.unreliable
    # The poisoned figure is replaced: >= 10x above it. Not "near `real`": the other pytest
    # worker may hold the cores during either measurement (seen: 14x lower on a 2-core EPYC).
    assert low.value > real / 100 and "re-measured" in low.source
    # Still impossible after measuring again (a FLOPs count gone wrong): unreliable, for good.
    p = pf.Peak(real, "measured", "fp32", gemm)
    assert not p.check(1e6) and p.unreliable and not p.check(0.5)
    # A datasheet peak is not measured again: the count is what is wrong.
    sheet = pf.Peak(989 * TFLOPS, "datasheet", "bf16", gemm, "cuda", measured=False)
    assert not sheet.check(1.2) and sheet.unreliable and not sheet.remeasured


def test_a_run_never_prints_mfu_above_100_percent(cache_dir, tmp_path):
    """The busy-machine case: the cached CPU peak is 1000x too low (as if measured while another
    job had the cores). The first record re-measures; no record says MFU above 100%."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    args = ["--ds_config", "zero1", "data.seq_length=64", "train.max_steps=4",
            "train.log_interval=1", "train.eval_interval=4", "train.save_interval=4",
            "train.eval_samples=8", "logging.plot=false", "logging.tensorboard=false"]
    first = launch(["--run_dir", tmp_path / "a", *args], 1, cache)
    peaks = json.loads((cache / "cpu_peaks.json").read_text())
    # this run's GEMM: 8 x 64 tokens x hidden 256 x vocabulary 4096, on 1 rank's threads, in its
    # precision (the shared cache may hold the other one's: bf16 "auto" is fp32 on some CPUs)
    threads = launched_threads(1)
    precision = re.search(r"ZeRO-1, (\w+)", first.stdout).group(1)
    (mine,) = [k for k in peaks if k.endswith(f" | {precision} | 512x256x4096")
               and f" {threads} threads " in k]
    (cache / "cpu_peaks.json").write_text(json.dumps({k: v / 1000 for k, v in peaks.items()}))
    proc = launch(["--run_dir", tmp_path / "b", *args], 1, cache)
    assert "cached in" in proc.stdout  # the poisoned figure was used at start
    train = [r for r in records(tmp_path / "b") if "loss" in r]
    assert len(train) == 4 and all(0 < r["mfu"] <= r["hfu"] <= 1 for r in train)
    assert "MFU n/a" not in proc.stdout
    fixed = json.loads((cache / "cpu_peaks.json").read_text())
    assert fixed[mine] > peaks[mine] / 10  # the cache holds the re-measured peak
    # and the log says the start line's figure was replaced, by what
    said = [l for l in proc.stdout.splitlines() if "measured again at step 1:" in l]
    assert said == [f"peak (MFU's denominator) measured again at step 1: "
                    f"{fixed[mine] / 1e12:.3f} TFLOP/s per rank, was "
                    f"{peaks[mine] / 1000 / 1e12:.3f} (MFU above 100% against it)"], proc.stdout
