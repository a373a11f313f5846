"""The torch implementations of RMSNorm, LayerNorm and SwiGLU, computing what reference.py
computes but keeping only their inputs (and per-row norm statistics) for the backward pass.

Written out as autograd functions because autograd, running reference.py's formulas, keeps every
intermediate its backward formulas read: RMSNorm's fp32 copy of the input and its fp32 normalized
output (8 bytes an element, while a bf16 input is 2 and is kept by the block anyway), SwiGLU's
silu(gate) (a third (tokens x ffn) tensor beside gate and up). Here the backward recomputes those
from the inputs (an elementwise pass, no matmul), as fused kernels do; the forward's outputs are
the same bits as reference.py's (the same operations in the same order). Measured side by side in
benchmarks/lm_head_loss.py, which trains a whole model.
"""
import torch
import torch.nn.functional as F


def _in(dtype, t: torch.Tensor) -> torch.Tensor:
    """`t` in `dtype`, converted only where it differs: under torch.compile in torch 2.11, an
    autograd.Function whose forward returned a same-dtype .to() of its result got all-zero
    gradients for every input (silently; measured on RMSNorm's fp32 path, right in 2.13)."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # fp32, one per row
        ctx.save_for_backward(x, weight, rstd)
        return _in(x.dtype, x32 * rstd * weight.float())

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad_out.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        g = g * weight.float()
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        # the ops autograd runs for reference.swiglu, so the same bits
        grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
        return grad_gate, grad_out * F.silu(gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


class _LayerNorm(torch.autograd.Function):
    """torch's own LayerNorm kernels in fp32 (native_layer_norm and its backward, the ops
    autograd runs for reference.layer_norm), keeping the input in its dtype and the fp32 mean and
    reciprocal std per row instead of autograd's fp32 copy of the input."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        shape = x.shape[-1:]
        w32 = weight.float()
        b32 = None if bias is None else bias.float()
        out, mean, rstd = torch.native_layer_norm(x.float(), shape, w32, b32, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return _in(x.dtype, out)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad_out.float(), x.float(), x.shape[-1:], mean, rstd, weight.float(),
            None if bias is None else bias.float(), list(want))
        return (None if dx is None else dx.to(x.dtype),
                None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None)


def layer_norm(x, weight, bias, eps: float) -> torch.Tensor:
    return _LayerNorm.apply(x, weight, bias, eps)
