"""Registration of every implementation shipped here, per op, best first:
fused CUDA (kernels/cuda) > Triton (kernels/triton) > apex (when importable) > torch (reference.py,
or a torch form of it that keeps the input dtype where the policy allows; RMSNorm, LayerNorm and
SwiGLU from lean_torch.py, the same forward keeping only its inputs for backward).
"""
import functools

import torch
import torch.nn.functional as F

from dr_scale.kernels import policy as P
from dr_scale.kernels import grouped, lean_torch, reference
from dr_scale.kernels.kernel import APEX, CUDA, TORCH, TRITON, register_kernel

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


def _flash_supports(head_dim=None, dropout=0.0, **_):
    if head_dim is not None and head_dim > 128:
        return f"head_dim {head_dim} > 128"
    if dropout:
        return f"it has no attention dropout (model.dropout={dropout}); sdpa and eager have"
    return None


# -- attention -----------------------------------------------------------------------------------
@register_kernel("attention", "triton_flash", priority=TRITON, devices=ANY, policy=P.ATTENTION,
                 available=_triton_unavailable, supports=_flash_supports,
                 auto_devices=TRITON_AUTO)
def attention_triton(q, k, v, causal=True, dropout_p=0.0, training=False, doc_ids=None):
    from dr_scale.kernels.triton import flash_attention

    if dropout_p and training:  # selection refuses this pairing; a direct call still learns why
        raise ValueError("triton_flash has no attention dropout; use model.attention=sdpa")
    return flash_attention(q, k, v, causal=causal, doc_ids=doc_ids)


_last_documents = {"ids": None, "lengths": None}
_last_block_mask = {"key": None, "mask": None}


def _document_block_mask(doc_ids, causal: bool, q_len: int, kv_len: int):
    """flex attention's block mask of the pairs in one document (and causal): made once for the
    ids tensor every layer of a forward gets."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (doc_ids, causal, q_len, kv_len)
    cached = _last_block_mask["key"]
    if cached is None or cached[0] is not doc_ids or cached[1:] != key[1:]:
        def same_document(b, h, q_idx, kv_idx):
            same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        _last_block_mask["mask"] = create_block_mask(same_document, doc_ids.shape[0], None,
                                                     q_len, kv_len, device=doc_ids.device)
        _last_block_mask["key"] = key
    return _last_block_mask["mask"]


@functools.lru_cache(maxsize=None)
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # compiled, it is one fused kernel; eager, torch's unfused reference (tests on CPU)
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def attention_by_block_mask(q, k, v, doc_ids, causal=True, gqa=False, compiled=True):
    """Attention within documents in one launch: flex attention over the same-document block
    mask (`compiled=False`: its eager form, for a check where inductor is not wanted)."""
    mask = _document_block_mask(doc_ids, causal, q.shape[2], k.shape[2])
    return _flex_attention(compiled)(q, k, v, block_mask=mask, enable_gqa=gqa)


def _document_lengths(doc_ids):
    """Per row, the lengths of its documents. Every layer of a forward (and its recomputation)
    gets the same ids tensor: they are read to the host once for it, not once a layer."""
    if _last_documents["ids"] is not doc_ids:
        _last_documents["lengths"] = [
            torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc_ids]
        _last_documents["ids"] = doc_ids
    return _last_documents["lengths"]


@register_kernel("attention", "sdpa", priority=TORCH + 1, devices=ANY, policy=P.ATTENTION)
def attention_sdpa(q, k, v, causal=True, dropout_p=0.0, training=False, doc_ids=None):
    """torch SDPA: picks flash / memory-efficient / math backends by itself; GQA natively.

    With `doc_ids` (packed documents), on a GPU: one launch of torch's flex attention (compiled)
    with a block mask of same-document (causal) pairs, made once per forward (every layer gets the
    same ids tensor), so blocks with no pair are skipped and nothing syncs with the host. On CPU
    each document's run of the sequence is its own causal SDPA call: measured on the 2-core EPYC
    (avx512_bf16), 12 heads x 64, 2,048 tokens, forward + backward: full causal 182 ms; one SDPA
    with the explicit (batch, 1, seq, seq) document mask 307 ms (CPU SDPA computes every masked
    block); flex_attention has no CPU backward in torch 2.13; per-document calls 61 ms with 8
    documents, 152 ms with 64 (fp32; bf16 156 / 269 / 50 / 73 ms). On a GPU `auto` measures it
    against triton_flash, which takes the ids inside its kernel (model.kernel_choice)."""
    dropout = dropout_p if training else 0.0
    gqa = k.shape[1] != q.shape[1]
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout,
                                              enable_gqa=gqa)
    if q.is_cuda and dropout == 0.0:  # flex attention has no dropout
        return attention_by_block_mask(q, k, v, doc_ids, causal, gqa)
    rows = []
    for b, lengths in enumerate(_document_lengths(doc_ids)):
        pieces, start = [], 0
        for n in lengths:
            part = slice(start, start + n)
            pieces.append(F.scaled_dot_product_attention(
                q[b:b + 1, :, part], k[b:b + 1, :, part], v[b:b + 1, :, part], is_causal=causal,
                dropout_p=dropout, enable_gqa=gqa))
            start += n
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _sdpa_backend(backend_name: str):
    """SDPA held to one of its backends (flash, cuDNN): on GPUs `auto` measures them against
    SDPA's own choice and triton_flash, so a faster backend is used where it wins (torch picks
    by fixed rules). The backward follows the backend the forward used."""
    def attention(q, k, v, causal=True, dropout_p=0.0, training=False, doc_ids=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return attention_sdpa(q, k, v, causal, dropout_p, training, doc_ids)
    return attention


def _cuda_device_unavailable():
    return None if torch.cuda.is_available() else "needs a CUDA device"


register_kernel("attention", "sdpa_flash", priority=TORCH + 1, devices=("cuda",),
                policy=P.ATTENTION, available=_cuda_device_unavailable)(
                    _sdpa_backend("FLASH_ATTENTION"))
register_kernel("attention", "sdpa_cudnn", priority=TORCH + 1, devices=("cuda",),
                policy=P.ATTENTION, available=_cuda_device_unavailable)(
                    _sdpa_backend("CUDNN_ATTENTION"))

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


register_kernel("rms_norm", "torch", priority=TORCH, devices=ANY, policy=P.NORM)(lean_torch.rms_norm)


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
                policy=P.NORM)(lean_torch.layer_norm)


# -- activations and rotary ----------------------------------------------------------------------
@register_kernel("swiglu", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.ELEMENTWISE,
                 available=_cuda_unavailable)
def swiglu_cuda(gate, up):
    from dr_scale.kernels import cuda

    return cuda.swiglu(gate, up)


register_kernel("swiglu", "torch", priority=TORCH, devices=ANY,
                policy=P.ELEMENTWISE)(lean_torch.swiglu)


@register_kernel("bias_gelu", "cuda_fused", priority=CUDA, devices=("cuda",),
                 policy=P.ELEMENTWISE, available=_cuda_unavailable)
def bias_gelu_cuda(x, bias):
    from dr_scale.kernels import cuda

    return cuda.bias_gelu(x, bias)


register_kernel("bias_gelu", "torch", priority=TORCH, devices=ANY,
                policy=P.ELEMENTWISE)(reference.bias_gelu)


def _one_table_per_sequence(per_token_positions=False, **_):
    return ("it takes one position table for the whole batch, not positions per token "
            "(data.reset_positions)") if per_token_positions else None


@register_kernel("rotary", "cuda_fused", priority=CUDA, devices=("cuda",), policy=P.ELEMENTWISE,
                 available=_cuda_unavailable, supports=_one_table_per_sequence)
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


# -- a mixture of experts' experts ---------------------------------------------------------------
register_kernel("experts", "grouped_mm", priority=TORCH + 1, devices=ANY, policy=P.GROUPED_MATMUL,
                available=grouped.grouped_mm_unavailable)(grouped.experts_grouped_mm)
register_kernel("experts", "loop", priority=TORCH, devices=ANY,
                policy=P.GROUPED_MATMUL)(grouped.experts_loop)
