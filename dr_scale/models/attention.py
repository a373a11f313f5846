"""Attention implementations selectable by name (`model.attention`)."""
import torch.nn.functional as F

from dr_scale.kernels import reference
from dr_scale.registry import ATTENTION_REGISTRY


@ATTENTION_REGISTRY.register("sdpa")
def sdpa_attention(q, k, v, causal=True, dropout_p=0.0, training=False):
    """torch SDPA: picks flash / memory-efficient / math backends by itself; GQA natively."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, dropout_p=dropout_p if training else 0.0,
        enable_gqa=k.shape[1] != q.shape[1])


@ATTENTION_REGISTRY.register("eager")
def eager_attention(q, k, v, causal=True, dropout_p=0.0, training=False):
    return reference.attention(q, k, v, causal=causal, dropout_p=dropout_p, training=training)


@ATTENTION_REGISTRY.register("triton_flash")
def triton_flash_attention(q, k, v, causal=True, dropout_p=0.0, training=False):
    """Flash attention in Triton (kernels/triton): CUDA, or CPU under TRITON_INTERPRET=1."""
    from dr_scale.kernels.builtin import attention_triton

    return attention_triton(q, k, v, causal=causal, dropout_p=dropout_p, training=training)
