"""Peak FLOP/s per rank, the denominator of MFU, and where it came from (said on the start line).

GPU: the vendor's dense (no sparsity) figure for the exact part, read from the device name; a
part not in the table measures a large matmul on itself. CPU: no datasheet fits a shared,
throttling, 2-core machine, so the peak is measured in this process, in the run's dtype, at the
model's largest GEMM shape, best of several tries, and cached per CPU model, threads, dtype and
shape (a later run on the same machine starts at once and compares like with like).

A measured peak can come out low (another process had the cores that moment). Two guards: each
CPU measurement records the share of its threads' time the process actually got, and a cached
figure measured on busy cores is measured again at the next start (the higher kept); and a run
whose figures contradict its peak (a whole step at more than PLAUSIBLE of the bare matmul, not
only above 100%) measures it again (`Peak.check`), and if the utilisation still cannot be true,
reports the peak as unreliable instead of printing the figure.
"""
import re
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dr_scale.runtime import disk_cache
from dr_scale.config import ds_config as dsc
from dr_scale.runtime.hardware import cpu_bf16_support, cpu_model

# Dense TFLOP/s by part, from the vendors' datasheets: (patterns all in the lowercased device
# name, {precision: TFLOP/s}). First match wins, so a part precedes the parts its name contains
# (H100 NVL before H100, L40S before L4, A100 before A10). fp32 is the non-tensor-core figure
# (torch's default matmul precision); missing precisions are measured. "hbm": memory bandwidth in
# TB/s (the fused kernels' share of it; A100/A800 at the 80 GB SXM part's figure).
_H100 = {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0}
GPU_PEAKS = (
    (("gb200",), {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "hbm": 8.0}),
    (("b200",), {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "hbm": 8.0}),
    (("b100",), {"bf16": 1800.0, "fp16": 1800.0, "fp8": 3500.0, "hbm": 8.0}),
    # GH200: the Hopper GPU of the Grace Hopper superchip ("NVIDIA GH200 480GB", 96 GB HBM3 at
    # 4.0 TB/s; the 144 GB HBM3e part 4.9), H100 SXM's compute; before H200, whose name it holds
    (("gh200",), {**_H100, "hbm": 4.0}),
    (("h200", "nvl"), {"bf16": 836.0, "fp16": 836.0, "fp8": 1671.0, "fp32": 60.0, "hbm": 4.8}),
    (("h200",), {**_H100, "hbm": 4.8}),
    (("h100", "nvl"), {"bf16": 835.0, "fp16": 835.0, "fp8": 1670.0, "fp32": 60.0, "hbm": 3.9}),
    (("h100", "pcie"), {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 51.0, "hbm": 2.0}),
    (("h100",), {**_H100, "hbm": 3.35}),         # SXM: "NVIDIA H100 80GB HBM3"
    (("h800", "pcie"), {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 51.0, "hbm": 2.0}),
    (("h800",), {**_H100, "hbm": 3.35}),
    (("h20",), {"bf16": 148.0, "fp16": 148.0, "fp8": 296.0, "fp32": 44.0, "hbm": 4.0}),
    (("a100",), {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "hbm": 2.039}),
    (("a800",), {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "hbm": 2.039}),
    (("a40",), {"bf16": 149.7, "fp16": 149.7, "fp32": 37.4, "hbm": 0.696}),
    (("a30",), {"bf16": 165.0, "fp16": 165.0, "fp32": 10.3, "hbm": 0.933}),
    (("l40s",), {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 91.6, "hbm": 0.864}),
    (("l40",), {"bf16": 181.0, "fp16": 181.0, "fp8": 362.0, "fp32": 90.5, "hbm": 0.864}),
    (("l4",), {"bf16": 121.0, "fp16": 121.0, "fp8": 242.0, "fp32": 30.3, "hbm": 0.3}),
    (("a10g",), None),                                     # cloud part, no public datasheet
    (("a10",), {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2, "hbm": 0.6}),
)

CPU_TRIES = 5
# A step is its matmuls plus attention's softmax, norms, the optimizer and communication: one
# that reaches 90% of the best bare matmul on the same threads says the peak was measured low.
PLAUSIBLE = 0.9
# Below this share of its threads' time (CPU time over wall time x threads) the measurement
# shared its cores with another process: its figure is low, not the machine's.
BUSY_SHARE = 0.8


def datasheet_peak(device_name: str, precision: str) -> Optional[float]:
    """FLOP/s for this exact part and precision, or None (not in the table)."""
    table = _part(device_name)
    return table[precision] * 1e12 if table and precision in table else None


def _part(device_name: str) -> Optional[dict]:
    words = device_name.lower()
    for patterns, table in GPU_PEAKS:
        if all(re.search(rf"(?<![0-9a-z]){p}(?![0-9a-z])", words) for p in patterns):
            return table
    return None


def datasheet_bandwidth(device_name: str) -> Optional[float]:
    """Memory bytes/s for this exact part, or None (not in the table)."""
    table = _part(device_name)
    return table["hbm"] * 1e12 if table and "hbm" in table else None


def measure_matmul(m: int, k: int, n: int, precision: str, device: str = "cpu",
                   tries: int = CPU_TRIES, min_seconds: float = 0.05) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) matmul over `tries` timed runs (each repeated until
    it lasts `min_seconds`), after a warm-up."""
    return _measure(m, k, n, precision, device, tries, min_seconds)[0]


def _measure(m, k, n, precision, device="cpu", tries=CPU_TRIES, min_seconds=0.05):
    """(best FLOP/s, the share of its threads' time this process got while measuring)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    best = _best_matmul(m, k, n, precision, device, tries, min_seconds)
    wall = time.perf_counter() - wall0
    share = (time.process_time() - cpu0) / (wall * torch.get_num_threads()) if wall else 1.0
    return best, min(1.0, share)


def _best_matmul(m, k, n, precision, device, tries, min_seconds) -> float:
    dtype = dsc.torch_dtype(precision)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.matmul(a, b)
    sync()
    best = 0.0
    for _ in range(tries):
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b)
            reps += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        best = max(best, 2.0 * m * k * n * reps / elapsed)
    return best


def largest_gemm(shape, tokens: int, tensor_parallel: int = 1) -> Tuple[int, int, int]:
    """(m, k, n) of the model's largest matmul on one rank: the LM head or the MLP's up
    projection, over the micro-batch's tokens (columns split across the tensor group)."""
    n = max(shape.vocab_size, shape.ffn_hidden_size) // max(1, tensor_parallel)
    return tokens, shape.hidden_size, max(1, n)


_CACHE = "cpu_peaks.json"


def _cpu_key(precision: str, gemm) -> str:
    """The machine (model, and whether bf16 runs natively under any oneDNN cap), the threads, the
    dtype and the shape: what the measured figure depends on."""
    return (f"{cpu_model()} | {cpu_bf16_support().why} | {torch.get_num_threads()} threads | "
            f"{precision} | {_dims(gemm)}")


def _dims(gemm) -> str:
    return "x".join(map(str, gemm))


def _cached(key: str) -> Tuple[float, float]:
    """(FLOP/s, the CPU share it was measured with) under `key`; (0, 0) when absent. A bare
    number (a cache from before the share was kept) counts as measured on busy cores."""
    entry = disk_cache.read(_CACHE).get(key)
    if isinstance(entry, dict):
        return float(entry.get("flops", 0.0)), float(entry.get("cpu_share", 0.0))
    return (float(entry), 0.0) if isinstance(entry, (int, float)) else (0.0, 0.0)


def _store(key: str, peak: float, share: float) -> float:
    """Keep the higher of the cached and the new figure under `key`, with the larger share (a
    cached figure a new measurement cannot beat stands confirmed); returns the kept figure."""
    cached, cached_share = _cached(key)
    if cached > peak:
        peak, share = cached, max(cached_share, share)
    disk_cache.store(_CACHE, key, {"flops": peak, "cpu_share": round(share, 3)})
    return peak


@dataclass
class Peak:
    """This rank's peak FLOP/s, where it came from, and how to measure it again."""
    value: float
    source: str
    precision: str
    gemm: Tuple[int, int, int]
    device: str = "cpu"
    measured: bool = True       # False: a datasheet figure
    remeasured: bool = False
    unreliable: bool = False    # an impossible utilisation survived a re-measurement

    def check(self, utilisation: float) -> bool:
        """Whether `utilisation` (achieved / peak, the largest of MFU and HFU) can be true.
        Above PLAUSIBLE, a measured peak is measured once more (the higher kept, the cache
        updated) and the caller divides again; above 1 after that, or above 1 against a
        datasheet figure (then the FLOPs count is what is wrong), the peak is unreliable."""
        if self.unreliable:
            return False
        if utilisation > PLAUSIBLE and self.measured and not self.remeasured:
            before = self.value
            again, share = _measure(*self.gemm, self.precision, self.device)
            self.value = _store(_cpu_key(self.precision, self.gemm), again, share) \
                if self.device == "cpu" else max(before, again)
            self.remeasured = True
            self.source += f"; re-measured after a utilisation of {100 * utilisation:.0f}%"
            utilisation *= before / self.value
        if utilisation <= 1.0:
            return True
        self.unreliable = True
        return False


def peak_flops(precision: str, device, gemm) -> Peak:
    """This rank's peak: a datasheet figure for a known GPU part; else measured (on CPU at the
    model's largest GEMM `gemm`, cached)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        value = datasheet_peak(name, precision)
        if value:
            return Peak(value, f"datasheet {name}, {precision} dense", precision, gemm,
                        str(device), measured=False)
        n = (8192, 8192, 8192)
        return Peak(measure_matmul(*n, precision, str(device), tries=3),
                    f"measured {precision} {_dims(n)} matmul on {name} (not in the datasheet "
                    f"table)", precision, n, str(device))
    key = _cpu_key(precision, gemm)
    where = f"{precision} matmul {_dims(gemm)}"
    cached, share = _cached(key)
    if cached and share >= BUSY_SHARE:
        return Peak(cached, f"measured {where}, cached in {disk_cache.cache_file(_CACHE)}",
                    precision, gemm)
    value = _store(key, *_measure(*gemm, precision))
    again = f" (the cached {cached / 1e12:.3f} TFLOP/s was measured on busy cores)" \
        if cached else ""
    return Peak(value, f"measured {where}, best of {CPU_TRIES}{again}", precision, gemm)
