"""Whether this machine's device computes bf16 natively, decided in one place.

bf16 pays only where the hardware has bf16 arithmetic: GPUs from sm_80 (A100, H100, H200) and
CPUs with AVX512-BF16 or AMX. Elsewhere bf16 is emulated through fp32 conversions; on a Xeon with
AVX-512 but neither, a bf16 matmul ran at 0.011-0.018 TFLOP/s per core against 0.038 for fp32,
so the bundled configs (`"bf16": {"enabled": "auto"}`) pick fp32 there.
"""
import os
from dataclasses import dataclass
from typing import FrozenSet

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) that stop below its bf16 kernels: a cap at one of these
# makes bf16 emulated even on a CPU whose flags say it has bf16.
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                             "AVX512_CORE_VNNI"}
# CPU flags (x86 /proc/cpuinfo "flags", Arm "Features") that mean bf16 dot products in hardware.
_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    why: str  # the evidence, said on the start line


def _cpuinfo(keys, path: str) -> str:
    """The first processor's value of the first of `keys` present ("" where the file is missing:
    not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags(path: str = "/proc/cpuinfo") -> FrozenSet[str]:
    """The first processor's flags (empty where the file is missing: not Linux)."""
    return frozenset(_cpuinfo(("flags", "Features"), path).split())


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    return _cpuinfo(("model name", "Model"), path) or "unknown cpu"


def cpu_bf16_support(flags=None, env=None) -> Bf16Support:
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    have = [f for f in _BF16_FLAGS if f in flags]
    if not have:
        if not flags:
            return Bf16Support(False, "CPU flags unreadable (no /proc/cpuinfo), bf16 assumed emulated")
        return Bf16Support(False, "CPU without avx512_bf16 or amx_bf16: bf16 is emulated")
    cap = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap in _ONEDNN_ISAS_WITHOUT_BF16:
        return Bf16Support(False, f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below its bf16 kernels: "
                                  "bf16 is emulated")
    return Bf16Support(True, f"CPU has {' and '.join(have)}")


def bf16_support(device_type: str) -> Bf16Support:
    """For the device this rank computes on ("cpu", "cuda", or another accelerator's name)."""
    if device_type == "cpu":
        return cpu_bf16_support()
    if device_type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            return Bf16Support(True, f"GPU sm_{major}{minor}")
        return Bf16Support(False, f"GPU sm_{major}{minor} (bf16 needs sm_80 or newer)")
    from deepspeed.accelerator import get_accelerator

    native = bool(get_accelerator().is_bf16_supported())
    return Bf16Support(native, f"{device_type} accelerator reports bf16 "
                               f"{'supported' if native else 'unsupported'}")
