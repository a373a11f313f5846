"""Triton kernels: flash attention and fused cross-entropy, each an autograd function checked
against its precision policy. They run on CUDA devices, and on CPU tensors under
TRITON_INTERPRET=1 (the Triton interpreter: slow, for tests)."""
import os

import torch

from dr_scale.errors import DrScaleError
from dr_scale.kernels import policy


def unavailable_reason():
    """None where Triton kernels can run, else why not."""
    try:
        import triton
    except ImportError:
        return "triton is not installed (pip install triton)"
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        import numpy

        return interpreter_conflict(triton.__version__, numpy.__version__)
    return "needs a CUDA device, or TRITON_INTERPRET=1 to run on CPU through the interpreter"


def _release(version: str) -> tuple:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


def interpreter_conflict(triton_version: str, numpy_version: str):
    """Why the interpreter cannot run these versions, or None. Triton's interpreter before 3.7
    turns one-element arrays into loop bounds with int(), which NumPy 2.4 refuses (every kernel
    with a data-dependent loop fails: triton-lang/triton#9171, fixed in 3.7; torch 2.11 pairs
    with Triton 3.6)."""
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"the Triton {triton_version} interpreter cannot run beside NumPy "
                f"{numpy_version} (triton-lang/triton#9171, fixed in Triton 3.7): install "
                f"'numpy<2.4' or 'triton>=3.7'")
    return None


def _check_device(op, *tensors):
    reason = unavailable_reason()
    if reason:
        raise DrScaleError(f"kernels.{op}=triton: {reason}")
    if tensors[0].device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise DrScaleError(f"kernels.{op}=triton: CPU tensors need TRITON_INTERPRET=1")


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, doc_ids):
        from dr_scale.kernels.triton import attention_kernels as fa

        q, k, v = (fa.head_dim_contiguous(t) for t in (q, k, v))  # strided views in place
        o, lse = fa.forward(q, k, v, causal, scale, doc_ids)
        ctx.save_for_backward(q, k, v, o, lse, doc_ids)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        from dr_scale.kernels.triton import attention_kernels as fa

        q, k, v, o, lse, doc_ids = ctx.saved_tensors
        dq, dk, dv = fa.backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, doc_ids)
        return dq, dk, dv, None, None, None


def _checked_doc_ids(doc_ids, q, k, causal):
    if doc_ids is None:
        return None
    b, seq = q.shape[0], q.shape[2]
    if not causal or k.shape[2] != seq or tuple(doc_ids.shape) != (b, seq) or \
            doc_ids.dtype.is_floating_point or doc_ids.device != q.device:
        raise DrScaleError(f"flash_attention: doc_ids must be an integer tensor of shape (batch, "
                           f"seq) = ({b}, {seq}) on {q.device}, with causal=True and as many keys "
                           f"as queries; got {tuple(doc_ids.shape)} {doc_ids.dtype} on "
                           f"{doc_ids.device}, causal={causal}, {k.shape[2]} keys")
    return doc_ids.to(torch.int32).contiguous()


def flash_attention(q, k, v, causal: bool = True, scale=None, doc_ids=None):
    """softmax(q k^T * scale [causal]) v. q: (batch, heads, seq_q, head_dim); k, v: (batch,
    kv_heads, seq_k, head_dim) with heads a multiple of kv_heads; head_dim <= 128. With
    `doc_ids` ((batch, seq) integers, non-decreasing along the sequence: packed documents), a
    query attends only to keys of its own document."""
    policy.ATTENTION.check("attention", "triton_flash", q, k, v)
    _check_device("attention", q)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise DrScaleError(f"flash_attention: expected q (b, h, s, d) and k, v of one shape "
                           f"(b, kv_h, s, d); got {tuple(q.shape)}, {tuple(k.shape)}, "
                           f"{tuple(v.shape)}")
    (b, h, sq, d), (bk, hk, sk, dk) = q.shape, k.shape
    if b != bk or d != dk or h % hk:
        raise DrScaleError(f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} need the "
                           f"same batch and head_dim, and heads a multiple of kv_heads")
    if d > 128:
        raise DrScaleError(f"flash_attention: head_dim {d} > 128 is not supported")
    doc_ids = _checked_doc_ids(doc_ids, q, k, causal)
    return _FlashAttention.apply(q, k, v, causal, d ** -0.5 if scale is None else float(scale),
                                 doc_ids)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        from dr_scale.kernels.triton import cross_entropy_kernels as ce

        logits = logits.contiguous()
        losses, lse = ce.forward(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return losses

    @staticmethod
    def backward(ctx, dlosses):
        from dr_scale.kernels.triton import cross_entropy_kernels as ce

        logits, targets, lse = ctx.saved_tensors
        return ce.backward(dlosses, logits, targets, lse, ctx.ignore_index), None, None


def cross_entropy(logits, targets, ignore_index: int = -100):
    """Mean token cross-entropy over targets != ignore_index, from (tokens, vocab) logits; the
    log-sum-exp and loss in fp32, the gradient written in the logits' dtype."""
    policy.CROSS_ENTROPY.check("cross_entropy", "triton_fused", logits)
    _check_device("cross_entropy", logits)
    logits2 = logits.reshape(-1, logits.shape[-1])
    targets1 = targets.reshape(-1)
    losses = _CrossEntropy.apply(logits2, targets1, ignore_index)
    count = (targets1 != ignore_index).sum().clamp(min=1)
    return losses.sum() / count


def cross_entropy_chunk(hidden, weight, targets, ignore_index: int, scale, want_grad: bool):
    """The fused LM head's step for one chunk of tokens (models/lm_head.py): the chunk's logits
    `hidden @ weight.T` in the weight's dtype, their summed loss (fp32) and, with `want_grad`,
    d(loss * scale)/d(logits) written over them. Two passes over the 16-bit logits; the torch path
    (reference.cross_entropy_chunk) makes an fp32 copy and passes over it five times."""
    from dr_scale.kernels.triton import cross_entropy_kernels as ce

    logits = hidden @ weight.t()
    policy.CROSS_ENTROPY.check("cross_entropy", "triton_fused", logits)
    _check_device("cross_entropy", logits)
    if not want_grad:
        return ce.forward(logits, targets, ignore_index)[0].sum(), None
    return ce.loss_and_grad_(logits, targets, scale, ignore_index).sum(), logits


def slice_logits_lse(hidden, weight, local_targets, ignore_index: int):
    """A vocabulary-parallel head's chunk (models/lm_head.py): this slice's logits in the weight's
    dtype, kept for `slice_grad_`, with their log-sum-exp and target logits (fp32) from one pass
    of the forward kernel; reference.slice_logits_lse keeps an fp32 copy instead."""
    from dr_scale.kernels.triton import cross_entropy_kernels as ce

    logits = hidden @ weight.t()
    policy.CROSS_ENTROPY.check("cross_entropy", "triton_fused", logits)
    _check_device("cross_entropy", logits)
    return (logits, *ce.slice_logits_lse(logits, local_targets.contiguous(), ignore_index))


def slice_grad_(logits, lse, local_targets, keep, ignore_index: int, scale, dtype):
    """The slice's logits gradient written over its 16-bit logits (already in `dtype`)."""
    from dr_scale.kernels.triton import cross_entropy_kernels as ce

    return ce.slice_grad_(logits, lse, local_targets, keep, ignore_index, scale)
