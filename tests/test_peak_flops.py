"""MFU's denominator: datasheet peaks by exact GPU part; on CPU a peak measured at the model's
largest GEMM, cached per machine with the share of the cores it got (a figure from busy cores is
measured again); an implausible utilisation re-measures, an impossible one is never printed, and
a benchmark row's MFU is its TFLOP/s over the peak it carries."""
import sys
import json
import re
import shutil
from pathlib import Path

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
    assert cache[key]["flops"] == first.value and 0 < cache[key]["cpu_share"] <= 1
    cache[key]["cpu_share"] = 1.0  # cores of our own (the other pytest worker may be busy now)
    (tmp_path / "cpu_peaks.json").write_text(json.dumps(cache))
    again = pf.peak_flops("fp32", torch.device("cpu"), gemm)
    assert again.value == first.value and "cached in" in again.source
    (tmp_path / "cpu_peaks.json").write_text("{not json")  # damaged: measured again
    assert "best of 5" in pf.peak_flops("fp32", torch.device("cpu"), gemm).source


@pytest.mark.parametrize("entry", [{"flops": 1e6, "cpu_share": 0.3}, 1e6],
                         ids=["busy cores", "share unknown"])
def test_a_peak_cached_from_busy_cores_is_measured_again(tmp_path, monkeypatch, entry):
    """The cached figure of a measurement that got 30% of its threads' time (another job had the
    cores), or one from a cache that never kept the share, is measured again at the next start:
    the higher figure is kept, and the start line says why it measured."""
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    gemm = (256, 128, 512)
    key = pf._cpu_key("fp32", gemm)
    (tmp_path / "cpu_peaks.json").write_text(json.dumps({key: entry}))
    peak = pf.peak_flops("fp32", torch.device("cpu"), gemm)
    assert peak.value > 1e7 and peak.source == ("measured fp32 matmul 256x128x512, best of 5 "
                                                "(the cached 0.000 TFLOP/s was measured on busy "
                                                "cores)")
    kept = json.loads((tmp_path / "cpu_peaks.json").read_text())[key]
    assert kept["flops"] == peak.value and kept["cpu_share"] > 0.3 - 1e-9


def test_a_utilisation_below_100_percent_can_still_contradict_the_peak(tmp_path, monkeypatch):
    """A whole step at 95% of a bare matmul (not impossible, not believable) measures the peak
    again; 50% does not."""
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    gemm = (256, 128, 512)
    real = pf.measure_matmul(*gemm, "fp32")
    calm = pf.Peak(real, "measured", "fp32", gemm)
    assert calm.check(0.5) and not calm.remeasured
    low = pf.Peak(real / 50, "measured", "fp32", gemm)  # a step at 1.9% reads as 95%
    assert low.check(0.95) and low.remeasured and low.value > real / 50 * 10
    assert low.source == "measured; re-measured after a utilisation of 95%"


def test_a_benchmark_rows_mfu_is_its_tflops_over_its_peak():
    """A run whose peak was measured again mid-run: its records carry two peaks (0.04 at start,
    0.08 after). The row carries the last, and its MFU and HFU are over that one, as each
    record's are (the row once said 0.048 TFLOP/s over a 0.040 peak beside an MFU of 74%)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from throughput import medians, utilisation

    info = {"peak_flops": {"value": 0.04e12, "source": "measured, cached"}}
    train = [{"tflops": 0.03, "mfu": 0.75, "hfu": 0.9, "peak_tflops": 0.04},
             {"tflops": 0.048, "mfu": 0.6, "hfu": 0.7, "peak_tflops": 0.08},
             {"tflops": 0.05, "mfu": 0.625, "hfu": 0.75, "peak_tflops": 0.08}]
    row = {"tflops": 0.048, **utilisation(train, info)}
    assert row["peak_tflops"] == 0.08 and row["mfu"] == pytest.approx(0.048 / 0.08, rel=1e-12)
    assert row["hfu"] == pytest.approx(0.056 / 0.08, rel=1e-12)  # median hardware TFLOP/s
    assert row["peak_source"] == "measured, cached; measured again during the run (0.0800 TFLOP/s)"
    # repeated runs: one row, over the largest peak, MFU again its TFLOP/s over it
    again = {**row, "tflops": 0.046, "peak_tflops": 0.09, "mfu": 0.046 / 0.09, "hfu": 0.6,
             "mem_peak_bytes": 1, "peak_source": "other"}
    both = medians([{**row, "mem_peak_bytes": 2}, again])
    assert both["peak_tflops"] == 0.09 and both["peak_source"] == "other"
    assert both["mfu"] == pytest.approx(both["tflops"] / 0.09, rel=1e-12)
    # a run whose peak turned unreliable has no MFU, and neither has the row
    gone = utilisation([{"tflops": 0.03, "peak_tflops": 0.04}], info)
    assert gone["mfu"] is None and gone["hfu"] is None


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
    # 1000x too low, yet recorded as measured on idle cores (so the start line trusts it)
    (cache / "cpu_peaks.json").write_text(json.dumps(
        {k: {"flops": v["flops"] / 1000, "cpu_share": 1.0} for k, v in peaks.items()}))
    proc = launch(["--run_dir", tmp_path / "b", *args], 1, cache)
    assert "cached in" in proc.stdout  # the poisoned figure was used at start
    train = [r for r in records(tmp_path / "b") if "loss" in r]
    assert len(train) == 4 and all(0 < r["mfu"] <= r["hfu"] <= 1 for r in train)
    assert "MFU n/a" not in proc.stdout
    fixed = json.loads((cache / "cpu_peaks.json").read_text())
    assert fixed[mine]["flops"] > peaks[mine]["flops"] / 10  # the cache holds the new peak
    # and the log says the start line's figure was replaced, by what
    said = [l for l in proc.stdout.splitlines() if "measured again at step 1:" in l]
    assert len(said) == 1 and re.fullmatch(
        re.escape(f"peak (MFU's denominator) measured again at step 1: "
                  f"{fixed[mine]['flops'] / 1e12:.3f} TFLOP/s per rank, was "
                  f"{peaks[mine]['flops'] / 1000 / 1e12:.3f} (HFU ") + r"\d+% against it\)",
        said[0]), proc.stdout
    # every record's MFU is its TFLOP/s over the peak it carries
    assert all(r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops"], rel=1e-9) for r in train)
