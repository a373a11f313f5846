"""Registration of every implementation shipped here, per op, best first:
fused CUDA (kernels/cuda) > Triton (kernels/triton) > apex (when importable) > torch (reference.py,
or a torch form of it that keeps the input dtype where the policy allows).
"""
import torch
import torch.nn.functional as F

from dr_scale.kernels import policy as P
from dr_scale.kernels import reference
from dr_scale.kernels.registry import APEX, CUDA, TORCH, TRITON, register_kernel

ANY = ("cpu", "cuda")
# Triton kernels run on CPU only through the interpreter (TRITON_INTERPRET=1): a test tool, far
# slower than torch, so `auto` never picks them there; naming them forces them.
TRITON_AUTO = ("cuda",)


def _cuda_unavailable():
    from dr_scale.kernels import cuda

    return cuda.unavailable_reason()


def _triton_unavailable():
    from dr_scale.kernels import triton as tk

    return tk.unavailable_reason()


def _apex_unavailable():
    try:
        import apex.normalization.fused_layer_norm  # noqa: F401
    except Exception:
        return "apex is not importable"
    return None


def _head_dim_supported(head_dim=None, **_):
    return None if head_dim is None or head_dim <= 128 else f"head_dim {head_dim} > 128"


# -- attention -----------------------------------------------------------------------------------
@register_kernel("attention", "triton_flash", priority=TRITON, devices=ANY, policy=P.ATTENTION,
                 available=_triton_unavailable, supports=_head_dim_supported,
                 auto_devices=TRITON_AUTO)
def attention_triton(q, k, v, causal=True, dropout_p=0.0, training=False):
    from dr_scale.kernels.triton import flash_attention

    if dropout_p and training:
        raise ValueError("triton_flash has no attention dropout; use model.attention=sdpa")
    return flash_attention(q, k, v, causal=causal)


@register_kernel("attention", "sdpa", priority=TORCH + 1, devices=ANY, policy=P.ATTENTION)
def attention_sdpa(q, k, v, causal=True, dropout_p=0.0, training=False):
    """torch SDPA: picks flash / memory-efficient / math backends by itself; GQA natively."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          dropout_p=dropout_p if training else 0.0,
                                          enable_gqa=k.shape[1] != q.shape[1])


register_kernel("attention", "eager", priority=TORCH, devices=ANY,
                policy=P.ATTENTION)(reference.attention)


# -- norms ---------------------------------------------------------------------------------------
@register_kernel("rms_norm", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.NORM,
                 available=_cuda_unavailable)
def rms_norm_cuda(x, weight, eps):
    from dr_scale.kernels import cuda

    return cuda.rms_norm(x, weight, eps)


@register_kernel("rms_norm", "apex", priority=APEX, devices=("cuda",), policy=P.NORM,
                 available=_apex_unavailable)
def rms_norm_apex(x, weight, eps):
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine

    return fused_rms_norm_affine(x, weight, weight.shape, eps)


register_kernel("rms_norm", "torch", priority=TORCH, devices=ANY, policy=P.NORM)(reference.rms_norm)


@register_kernel("layer_norm", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.NORM,
                 available=_cuda_unavailable)
def layer_norm_cuda(x, weight, bias, eps):
    from dr_scale.kernels import cuda

    return cuda.layer_norm(x, weight, bias, eps)


@register_kernel("layer_norm", "apex", priority=APEX, devices=("cuda",), policy=P.NORM,
                 available=_apex_unavailable)
def layer_norm_apex(x, weight, bias, eps):
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    return fused_layer_norm_affine(x, weight, bias, weight.shape, eps)


register_kernel("layer_norm", "torch", priority=TORCH, devices=ANY,
                policy=P.NORM)(reference.layer_norm)


# -- activations and rotary ----------------------------------------------------------------------
@register_kernel("swiglu", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.ELEMENTWISE,
                 available=_cuda_unavailable)
def swiglu_cuda(gate, up):
    from dr_scale.kernels import cuda

    return cuda.swiglu(gate, up)


register_kernel("swiglu", "torch", priority=TORCH, devices=ANY,
                policy=P.ELEMENTWISE)(reference.swiglu)


@register_kernel("bias_gelu", "cuda_fused", priority=CUDA, devices=("cuda",),
                 policy=P.ELEMENTWISE, available=_cuda_unavailable)
def bias_gelu_cuda(x, bias):
    from dr_scale.kernels import cuda

    return cuda.bias_gelu(x, bias)


register_kernel("bias_gelu", "torch", priority=TORCH, devices=ANY,
                policy=P.ELEMENTWISE)(reference.bias_gelu)


@register_kernel("rotary", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.ELEMENTWISE,
                 available=_cuda_unavailable)
def rotary_cuda(x, cos, sin):
    from dr_scale.kernels import cuda

    return cuda.apply_rotary(x, cos, sin)


@register_kernel("rotary", "torch", priority=TORCH, devices=ANY, policy=P.ELEMENTWISE)
def rotary_torch(x, cos, sin):
    """The rotation in the input's dtype, as Hugging Face's Llama computes it. The fp32 reference
    (reference.apply_rotary) makes two fp32 copies of q and k: on a CPU bf16 step of llama_125m it
    took 5.1 ms against 2.1 ms per call (forward + backward), for a difference within the bf16
    tolerance (max 0.7% of the largest value)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos.to(x.dtype), rotated, sin.to(x.dtype))


# -- loss ----------------------------------------------------------------------------------------
@register_kernel("cross_entropy", "triton_fused", priority=TRITON, devices=ANY,
                 policy=P.CROSS_ENTROPY, available=_triton_unavailable, auto_devices=TRITON_AUTO)
def cross_entropy_triton(logits, labels, ignore_index=-100):
    from dr_scale.kernels.triton import cross_entropy

    return cross_entropy(logits, labels, ignore_index)


register_kernel("cross_entropy", "torch", priority=TORCH, devices=ANY,
                policy=P.CROSS_ENTROPY)(reference.cross_entropy)
