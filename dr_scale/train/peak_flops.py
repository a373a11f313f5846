"""Peak FLOP/s per rank, the denominator of MFU: a table for known GPUs; on CPU, a matmul
measured in this process with the threads this rank has (so MFU compares like with like)."""
import time

import torch

# Dense (no sparsity) peak, TFLOP/s, from the vendors' datasheets (SXM parts).
GPU_PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "tf32": 156.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0, "tf32": 494.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0, "tf32": 494.0},
}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gpu_peak(device_name: str, precision: str):
    for key, table in GPU_PEAK_TFLOPS.items():
        if key in device_name.upper():
            return table.get(precision, table["bf16"]) * 1e12
    return None


def measure_matmul_flops(precision: str = "bf16", n: int = 1024, seconds: float = 0.5,
                         device: str = "cpu") -> float:
    """Best FLOP/s of an n x n matmul in ``precision`` over about ``seconds``."""
    dtype = _DTYPES.get(precision, torch.float32)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm up (packing, thread pool)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def peak_flops(precision: str, device_type: str, device_name: str = ""):
    """(FLOP/s, where it came from)."""
    if device_type == "cuda":
        peak = gpu_peak(device_name, precision)
        if peak:
            return peak, f"datasheet {device_name} {precision}"
    return measure_matmul_flops(precision), f"measured {precision} matmul, {torch.get_num_threads()} threads"
