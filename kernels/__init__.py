"""Kernels, installed as `dr_scale.kernels`.

reference.py  the pure-torch definition of every op: what runs on CPU, what the rest is tested against
policy.py     precision policies (accepted dtypes, what runs in fp32, tolerances)
registry.py   per-op implementations and the choice among them; builtin.py registers ours
ops.py        what the model calls: dispatches to the chosen implementation
triton/       flash attention and fused cross-entropy
cuda/         fused norms, SwiGLU, bias + GeLU, rotary (.cu files + a thin torch binding)

    from dr_scale.kernels import flash_attention
    out = flash_attention(q, k, v, causal=True)
"""
from dr_scale.kernels import reference  # noqa: F401


def __getattr__(name):
    # Triton is imported only when a Triton kernel is asked for.
    if name in ("flash_attention", "cross_entropy"):
        from dr_scale.kernels import triton as triton_kernels

        return getattr(triton_kernels, name)
    raise AttributeError(f"module 'dr_scale.kernels' has no attribute {name!r}")
