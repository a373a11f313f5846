"""Fused cross-entropy in Triton: one program per row streams the vocabulary in blocks (online
max and sum, fp32), so the (tokens, vocab) softmax is never materialized in the forward; the
backward writes softmax - onehot in one pass from the saved log-sum-exp."""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ce_fwd_kernel(LOGITS, TARGETS, LOSSES, LSE, stride, V, IGNORE,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride
    target = tl.load(TARGETS + row)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes past the vocabulary have seen only -inf: shift by 0 there (no -inf - -inf)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    x_t = tl.load(base + target, mask=target != IGNORE, other=0.0).to(tl.float32)
    loss = tl.where(target != IGNORE, lse - x_t, 0.0)
    tl.store(LOSSES + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd_kernel(DLOSSES, LOGITS, DLOGITS, TARGETS, LSE, stride, V, IGNORE,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * stride
    target = tl.load(TARGETS + row)
    dloss = tl.load(DLOSSES + row).to(tl.float32)
    dloss = tl.where(target != IGNORE, dloss, 0.0)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(LOGITS + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(DLOGITS + base + cols, (g * dloss).to(DLOGITS.dtype.element_ty), mask=mask)


def _block(V):
    return min(triton.next_power_of_2(V), 1024 if INTERPRET else 4096)


def forward(logits, targets, ignore_index):
    n, V = logits.shape
    losses = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    _ce_fwd_kernel[(n,)](logits, targets.contiguous(), losses, lse, logits.stride(0), V,
                         ignore_index, BLOCK_V=_block(V))
    return losses, lse


def backward(dlosses, logits, targets, lse, ignore_index):
    n, V = logits.shape
    dlogits = torch.empty_like(logits)
    _ce_bwd_kernel[(n,)](dlosses.contiguous(), logits, dlogits, targets.contiguous(), lse,
                         logits.stride(0), V, ignore_index, BLOCK_V=_block(V))
    return dlogits


def loss_and_grad_(logits, targets, scale, ignore_index):
    """Per-row losses (fp32; 0 where the target is ignored), then (softmax - onehot) * scale
    written over `logits` in place: the backward kernel reads each element before its program
    writes it, so one buffer serves (the fused LM head's chunk: no fp32 copy of it is made)."""
    n, V = logits.shape
    losses, lse = forward(logits, targets, ignore_index)
    _ce_bwd_kernel[(n,)](_per_row(scale, n, logits.device), logits, logits, targets.contiguous(),
                         lse, logits.stride(0), V, ignore_index, BLOCK_V=_block(V))
    return losses


def slice_logits_lse(logits, local_targets, ignore_index):
    """A vocabulary slice's log-sum-exp per row and each row's target logit (0 where the target
    is `ignore_index`: elsewhere or ignored), from the forward kernel's one pass over the 16-bit
    logits (its loss there is lse - target logit)."""
    losses, lse = forward(logits, local_targets, ignore_index)
    mine = local_targets != ignore_index
    return lse, torch.where(mine, lse - losses, 0.0)


def slice_grad_(logits, lse, local_targets, keep, ignore_index, scale):
    """(softmax - onehot) * scale over a vocabulary slice's logits in place, from the whole
    vocabulary's `lse`: rows whose target is in another slice get the softmax alone (target -1
    matches no column), ignored rows 0 (the kernel zeroes rows whose target is `ignore_index`)."""
    n, V = logits.shape
    targets = torch.where(local_targets != ignore_index, local_targets,
                          torch.where(keep, -1, ignore_index)).contiguous()
    _ce_bwd_kernel[(n,)](_per_row(scale, n, logits.device), logits, logits, targets,
                         lse.contiguous(), logits.stride(0), V, ignore_index, BLOCK_V=_block(V))
    return logits


def _per_row(scale, n, device):
    """The backward kernel's per-row loss gradient: `scale` (a number or a 0-d tensor) for each
    of `n` rows, fp32."""
    return torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(1).expand(n) \
        .contiguous()
