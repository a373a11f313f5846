"""Fused CUDA kernels (norms, SwiGLU, bias + GeLU, rotary) as autograd functions.

The kernels are torch-free .cu files behind a C interface (dr_kernels.h); binding.cpp is a thin
torch layer over it. The extension is built by torch.utils.cpp_extension on first use on a GPU
(a minute or two, then cached in ~/.cache/torch_extensions).
"""
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = ["binding.cpp", "norms.cu", "activations.cu", "rotary.cu"]
_ext = None
_failure = None


def unavailable_reason():
    """None where the extension can be built and run here, else why not (the build is tried)."""
    global _failure
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if _ext is None and _failure is None:
        try:
            extension()
        except Exception as e:  # a failed build falls back to the next implementation, said once
            _failure = f"the CUDA extension did not build: {str(e).splitlines()[0]}"
    return _failure


def extension():
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load

        _ext = load(name="dr_scale_cuda", sources=[str(HERE / s) for s in SOURCES],
                    extra_include_paths=[str(HERE)], extra_cflags=["-O3", "-std=c++20"],
                    extra_cuda_cflags=["-O3", "-std=c++20"], verbose=False)
    return _ext


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _rows(x):
    return x.contiguous().view(-1, x.shape[-1])


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = _rows(x)
        y, rstd = extension().rms_norm_fwd(x2, weight.contiguous(), eps, _stream())
        ctx.save_for_backward(x2, weight, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = extension().rms_norm_bwd(_rows(dy), x2, weight.contiguous(), rstd, _stream())
        return dx.view(dy.shape), dw, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = _rows(x)
        y, mean, rstd = extension().layer_norm_fwd(x2, weight.contiguous(), bias.contiguous(), eps,
                                                   _stream())
        ctx.save_for_backward(x2, weight, mean, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = extension().layer_norm_bwd(_rows(dy), x2, weight.contiguous(), mean, rstd,
                                                _stream())
        return dx.view(dy.shape), dw, db, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return extension().swiglu_fwd(gate, up, _stream())

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = extension().swiglu_bwd(dy.contiguous(), gate, up, _stream())
        return dgate, dup


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x, bias = x.contiguous(), bias.contiguous()
        ctx.save_for_backward(x, bias)
        return extension().bias_gelu_fwd(x, bias, _stream())

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = extension().bias_gelu_bwd(dy.contiguous(), x, bias, _stream())
        return dx, dx.view(-1, dx.shape[-1]).float().sum(0).to(bias.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return extension().rotary(x.contiguous(), cos, sin, 1.0, _stream())

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return extension().rotary(dy.contiguous(), cos, sin, -1.0, _stream()), None, None


def rms_norm(x, weight, eps):
    return _RMSNorm.apply(x, weight, float(eps))


def layer_norm(x, weight, bias, eps):
    return _LayerNorm.apply(x, weight, bias, float(eps))


def swiglu(gate, up):
    return _SwiGLU.apply(gate, up)


def bias_gelu(x, bias):
    return _BiasGelu.apply(x, bias)


def apply_rotary(x, cos, sin):
    """x: (batch, heads, seq, head_dim); cos, sin: (seq, head_dim)."""
    return _Rotary.apply(x, cos, sin)
