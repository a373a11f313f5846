"""The fused kernels as torch.library custom ops (`torch.ops.dr_scale.*`): each with its CUDA
implementation (the extension), a CPU implementation (the same math in torch, fp32 inside), a
fake implementation (shapes only, for torch.compile and the meta device) and its autograd. Ops, not
autograd Functions over pybind calls, so `model.compile` traces through them and keeps whole graphs
(tests/test_kernels_cuda_ops.py compiles them with fullgraph=True through the CPU implementations).

Inputs are rows (rows, cols), contiguous, one dtype (weights included); the binding checks device,
dtype, shape and contiguity of every argument on CUDA and refuses anything else in one line.
"""
from typing import Tuple

import torch
from torch import Tensor

_OPTS = {"mutates_args": ()}


def _ext():
    from dr_scale.kernels.cuda import extension

    return extension()


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _rows_like(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], dtype=torch.float32)


# -- RMSNorm -------------------------------------------------------------------------------------
@torch.library.custom_op("dr_scale::rms_norm_fwd", device_types="cuda", **_OPTS)
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    y, rstd = _ext().rms_norm_fwd(x, weight, eps, _stream())
    return y, rstd


@rms_norm_fwd.register_kernel("cpu")
def _(x, weight, eps):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return (x32 * rstd[:, None] * weight.float()).to(x.dtype), rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), _rows_like(x)


@torch.library.custom_op("dr_scale::rms_norm_bwd", device_types="cuda", **_OPTS)
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> Tuple[Tensor, Tensor]:
    dx, dw = _ext().rms_norm_bwd(dy, x, weight, rstd, _stream())
    return dx, dw


@rms_norm_bwd.register_kernel("cpu")
def _(dy, x, weight, rstd):
    xhat = x.float() * rstd[:, None]
    g = dy.float() * weight.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xhat).sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


# -- LayerNorm -----------------------------------------------------------------------------------
@torch.library.custom_op("dr_scale::layer_norm_fwd", device_types="cuda", **_OPTS)
def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor,
                   eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, rstd = _ext().layer_norm_fwd(x, weight, bias, eps, _stream())
    return y, mean, rstd


@layer_norm_fwd.register_kernel("cpu")
def _(x, weight, bias, eps):
    x32 = x.float()
    mean = x32.mean(-1)
    rstd = torch.rsqrt((x32 - mean[:, None]).pow(2).mean(-1) + eps)
    y = (x32 - mean[:, None]) * rstd[:, None] * weight.float() + bias.float()
    return y.to(x.dtype), mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x), _rows_like(x), _rows_like(x)


@torch.library.custom_op("dr_scale::layer_norm_bwd", device_types="cuda", **_OPTS)
def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                   rstd: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _ext().layer_norm_bwd(dy, x, weight, mean, rstd, _stream())
    return dx, dw, db


@layer_norm_bwd.register_kernel("cpu")
def _(dy, x, weight, mean, rstd):
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    dy32 = dy.float()
    g = dy32 * weight.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return (dx.to(x.dtype), (dy32 * xhat).sum(0).to(weight.dtype),
            dy32.sum(0).to(weight.dtype))


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _ln_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(dy.contiguous(), x, weight, mean, rstd)
    return dx, dw, db, None


layer_norm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


# -- SwiGLU --------------------------------------------------------------------------------------
@torch.library.custom_op("dr_scale::swiglu_fwd", device_types="cuda", **_OPTS)
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return _ext().swiglu_fwd(gate, up, _stream())


@swiglu_fwd.register_kernel("cpu")
def _(gate, up):
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)


@swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("dr_scale::swiglu_bwd", device_types="cuda", **_OPTS)
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    dgate, dup = _ext().swiglu_bwd(dy, gate, up, _stream())
    return dgate, dup


@swiglu_bwd.register_kernel("cpu")
def _(dy, gate, up):
    g, dy32 = gate.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = dy32 * up.float() * s * (1 + g * (1 - s))
    return dgate.to(gate.dtype), (dy32 * g * s).to(up.dtype)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dy.contiguous(), gate, up)


swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# -- bias + GeLU (tanh) --------------------------------------------------------------------------
@torch.library.custom_op("dr_scale::bias_gelu_fwd", device_types="cuda", **_OPTS)
def bias_gelu_fwd(x: Tensor, bias: Tensor) -> Tensor:
    return _ext().bias_gelu_fwd(x, bias, _stream())


@bias_gelu_fwd.register_kernel("cpu")
def _(x, bias):
    return torch.nn.functional.gelu(x.float() + bias.float(), approximate="tanh").to(x.dtype)


@bias_gelu_fwd.register_fake
def _(x, bias):
    return torch.empty_like(x)


@torch.library.custom_op("dr_scale::bias_gelu_bwd", device_types="cuda", **_OPTS)
def bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    return _ext().bias_gelu_bwd(dy, x, bias, _stream())


@bias_gelu_bwd.register_kernel("cpu")
def _(dy, x, bias):
    return torch.ops.aten.gelu_backward(dy.float(), x.float() + bias.float(),
                                        approximate="tanh").to(x.dtype)


@bias_gelu_bwd.register_fake
def _(dy, x, bias):
    return torch.empty_like(x)


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx = bias_gelu_bwd(dy.contiguous(), x, bias)
    return dx, dx.view(-1, dx.shape[-1]).float().sum(0).to(bias.dtype)


bias_gelu_fwd.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


# -- rotary --------------------------------------------------------------------------------------
@torch.library.custom_op("dr_scale::rotary", device_types="cuda", **_OPTS)
def rotary(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """x (batch, heads, seq, head_dim); cos, sin fp32 (seq, head_dim); sign -1: the transpose
    (the backward pass)."""
    return _ext().rotary(x, cos, sin, sign, _stream())


@rotary.register_kernel("cpu")
def _(x, cos, sin, sign):
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * (sin * sign)).to(x.dtype)


@rotary.register_fake
def _(x, cos, sin, sign):
    return torch.empty_like(x)


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.sign = sign


def _rotary_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rotary(dy.contiguous(), cos, sin, -ctx.sign), None, None, None


rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)
