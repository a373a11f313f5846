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
import sys as _sys

if __name__ == "kernels":
    def _hand_the_bare_name_over():
        """Imported as a bare `kernels`: Python puts the working directory (or a script's folder)
        first on sys.path, so code run from this checkout's root finds this folder under that
        name, hiding PyPI's `kernels` (Hugging Face's hub kernels, which transformers requires and
        imports since 5.25). Where that package is installed, the name is handed to it: the
        import returns it (the import system takes the module a package leaves in sys.modules).
        Installed, this folder is only ever `dr_scale.kernels`."""
        import importlib.machinery
        import importlib.util
        import os

        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        elsewhere = [e for e in _sys.path if os.path.abspath(e or os.curdir) != checkout]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            _sys.modules["kernels"] = module
            spec.loader.exec_module(module)

    _hand_the_bare_name_over()

from dr_scale.kernels import reference  # noqa: E402,F401


def __getattr__(name):
    # Triton is imported only when a Triton kernel is asked for.
    if name in ("flash_attention", "cross_entropy"):
        from dr_scale.kernels import triton as triton_kernels

        return getattr(triton_kernels, name)
    raise AttributeError(f"module 'dr_scale.kernels' has no attribute {name!r}")
