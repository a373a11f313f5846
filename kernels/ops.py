"""The ops the model calls. Each dispatches to the implementation chosen for this process by
`use_kernels` (the launcher does it once at start, from `model.kernels`); until then, the torch
reference. Kept as module-level functions so the model stays plain PyTorch.
"""
from typing import Dict, Optional

from dr_scale.kernels import reference
from dr_scale.kernels.registry import TORCH, Kernel, describe, select

OPS = ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rotary", "cross_entropy", "experts")
_REFERENCES = {"rms_norm": reference.rms_norm, "layer_norm": reference.layer_norm,
               "swiglu": reference.swiglu, "bias_gelu": reference.bias_gelu,
               "rotary": reference.apply_rotary, "cross_entropy": reference.cross_entropy,
               "experts": reference.grouped_experts}
_active = dict(_REFERENCES)
_chosen: Dict[str, Kernel] = {}


def use_kernels(device_type: str, dtype=None, forced: Optional[Dict[str, str]] = None,
                unused=(), **shape) -> str:
    """Choose every op's implementation: the forced name where given (one-line error if it cannot
    run here), else the best available that takes `shape` (facts of the run, such as
    per_token_positions); ops in `unused` (a dense model's experts) keep the reference and are
    not said. Returns the line to print once at start."""
    forced = dict(forced or {})
    for op in OPS:
        if op in unused:
            continue
        choice = forced.get(op, "auto")
        kernel = select(op, device_type, dtype, force=None if choice == "auto" else choice,
                        **shape)
        _chosen[op] = kernel
        _active[op] = _checked(kernel)
    return describe(_chosen)


def reset():
    """Back to the torch references (tests)."""
    _chosen.clear()
    _active.update(_REFERENCES)


def _checked(kernel: Kernel):
    if kernel.priority <= TORCH:  # the torch reference accepts every float dtype: no check
        return kernel.fn

    def call(x, *args, **kwargs):
        kernel.policy.check(kernel.op, kernel.name, x)
        return kernel.fn(x, *args, **kwargs)
    return call


def rms_norm(x, weight, eps):
    return _active["rms_norm"](x, weight, eps)


def layer_norm(x, weight, bias, eps):
    return _active["layer_norm"](x, weight, bias, eps)


def swiglu(gate, up):
    return _active["swiglu"](gate, up)


def bias_gelu(x, bias):
    return _active["bias_gelu"](x, bias)


def apply_rotary(x, cos, sin):
    return _active["rotary"](x, cos, sin)


def cross_entropy(logits, labels, ignore_index: int = -100):
    return _active["cross_entropy"](logits, labels, ignore_index)


def grouped_experts(x, w1, w2, w3, counts):
    return _active["experts"](x, w1, w2, w3, counts, swiglu=_active["swiglu"])


def _fused_head_kernels():
    """Where the fused LM head's chunk kernels come from: the module of the cross-entropy
    implementation chosen for this run (Triton's where it was chosen, else the torch reference)."""
    chosen = _chosen.get("cross_entropy")
    if chosen is not None and chosen.name == "triton_fused":
        from dr_scale.kernels import triton

        return triton
    return reference


def cross_entropy_chunk(hidden, weight, targets, ignore_index: int, scale, want_grad: bool):
    """The fused LM head's per-chunk logits, loss and logits gradient (models/lm_head.py), by the
    same choice as `cross_entropy`."""
    return _fused_head_kernels().cross_entropy_chunk(hidden, weight, targets, ignore_index, scale,
                                                     want_grad)


def slice_logits_lse(hidden, weight, local_targets, ignore_index: int):
    """A vocabulary-parallel head's chunk: (state kept for slice_grad_, the slice's log-sum-exp,
    the target logits); the tensor group combines the last two (models/lm_head.py)."""
    return _fused_head_kernels().slice_logits_lse(hidden, weight, local_targets, ignore_index)


def slice_grad_(state, lse, local_targets, keep, ignore_index: int, scale, dtype):
    """The slice's logits gradient from the whole vocabulary's log-sum-exp, over `state`."""
    return _fused_head_kernels().slice_grad_(state, lse, local_targets, keep, ignore_index,
                                             scale, dtype)
