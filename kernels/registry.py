"""Kernel registry: per op, the implementations with the devices, dtypes and shapes each
supports. `select` picks the best available one by priority (fused CUDA > Triton > apex > torch),
or the one forced by name; on GPUs `auto` is decided by measurement among `candidates` instead
(measured.py); the model says its choices once at start (`describe`).

    @register_kernel("rms_norm", "cuda_fused", priority=CUDA, devices=("cuda",), policy=NORM,
                     available=cuda_extension_available)
    def rms_norm_cuda(x, weight, eps): ...
"""
from typing import Dict, List, Optional

from dr_scale.errors import DrScaleError
from dr_scale.kernels.kernel import (APEX, CUDA, KERNELS, TORCH, TRITON, Kernel,  # noqa: F401
                                     register_kernel)


def select(op: str, device_type: str, dtype=None, force: Optional[str] = None, **shape) -> Kernel:
    _load_builtin()
    if op not in KERNELS:
        raise DrScaleError(f"kernels: unknown op '{op}'; known: {', '.join(sorted(KERNELS))}")
    impls = KERNELS[op]
    if force:
        if force not in impls:
            raise DrScaleError(f"kernels.{op}: unknown implementation '{force}'; known: "
                               f"{', '.join(sorted(impls))}")
        reason = impls[force].why_not(device_type, dtype, **shape)
        if reason:
            raise DrScaleError(f"kernels.{op}={force}: cannot run here: {reason}")
        return impls[force]
    found = candidates(op, device_type, dtype, **shape)
    if not found:
        raise DrScaleError(f"kernels.{op}: no implementation runs on {device_type}")
    return found[0]


def candidates(op: str, device_type: str, dtype=None, **shape) -> List[Kernel]:
    """The implementations `auto` may use for `op` here, best priority first (on GPUs they are
    measured against each other: measured.py)."""
    _load_builtin()
    return [k for k in sorted(KERNELS.get(op, {}).values(), key=lambda k: -k.priority)
            if device_type in k.auto_devices and k.why_not(device_type, dtype, **shape) is None]


def unavailable(device_type: str) -> Dict[str, List[str]]:
    """Why registered implementations for this device cannot run here (a failed CUDA build, a
    missing library): {reason: ["op=name", ...]}, for the launcher to say once at start."""
    _load_builtin()
    found: Dict[str, List[str]] = {}
    for op, impls in KERNELS.items():
        for k in impls.values():
            if device_type in k.auto_devices:
                reason = k.available()
                if reason:
                    found.setdefault(reason, []).append(f"{op}={k.name}")
    return found


def implementation(op: str, name: str) -> Kernel:
    """The implementation registered under `name` (no availability check: `select` does that
    once at start); the model resolves `model.attention` here, from the table `auto` picks from."""
    _load_builtin()
    impls = KERNELS.get(op, {})
    if name not in impls:
        raise DrScaleError(f"unknown {op} implementation '{name}'; known: "
                           f"{', '.join(sorted(impls))}")
    return impls[name]


def describe(choices: Dict[str, Kernel]) -> str:
    return "kernels: " + ", ".join(f"{op}={k.name}" for op, k in choices.items())


def _load_builtin():
    """Importing the implementation modules registers them."""
    from dr_scale.kernels import builtin  # noqa: F401
