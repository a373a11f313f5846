"""Pure-torch reference ops. Statistics (norms, softmax, loss) are computed in fp32 whatever the
input dtype, and cast back, as the fused kernels do."""
import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x, weight, bias, eps: float):
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(),
                        None if bias is None else bias.float(), eps).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation, as GPT-2) of x + bias, computed in fp32."""
    return F.gelu(x.float() + bias.float(), approximate="tanh").to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device="cpu",
                  scale_frequencies=None):
    """cos and sin of shape (seq, head_dim), fp32, in the half-split layout Llama checkpoints
    use; `scale_frequencies` maps the inverse frequencies (long-context scaling), if given.

    Positions and exponents are counted in int64 and converted with `.float()`, on an explicit
    device: a floating constructor may be rewritten behind our back (DeepSpeed's zero.Init casts
    every floating tensor that torch.arange makes to the training dtype, an explicit dtype
    included, and puts it on the accelerator), and bf16 positions collapse past 256."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scale_frequencies is not None:
        inv_freq = scale_frequencies(inv_freq)
    t = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotate pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def attention(q, k, v, causal: bool = True, dropout_p: float = 0.0, training: bool = False,
              doc_ids=None):
    """Eager attention. q: (B, H, Sq, D); k, v: (B, KVH, Sk, D) with H a multiple of KVH. The
    causal mask is top-left aligned, as torch SDPA's `is_causal` and our Triton kernel: query i
    sees keys 0..i (bottom-right alignment disagreed with both when Sq != Sk, and left rows with
    no key at all, NaN, when Sq > Sk). With `doc_ids` (B, S) (packed documents, Sq == Sk), query
    i sees only keys of its own document."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    if doc_ids is not None:
        same = (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)
        scores = scores.masked_fill(~same, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p and training:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """Mean token cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index)


def cross_entropy_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int, scale, want_grad: bool):
    """The fused LM head's step for one chunk of tokens (models/lm_head.py): the chunk's logits
    `hidden @ weight.T`, their summed loss in fp32 and, with `want_grad`, d(loss * scale)/d(logits)
    = (softmax - one_hot) * scale in the weight's dtype (0 on ignored rows), computed in fp32 over
    one copy of the logits (the 16-bit product is freed as it is copied)."""
    keep = targets != ignore_index
    x = (hidden @ weight.t()).float()
    target = targets.masked_fill(~keep, 0)
    picked = x.gather(1, target[:, None]).squeeze(1)
    lse = torch.logsumexp(x, dim=-1)
    loss = ((lse - picked) * keep).sum()
    if not want_grad:
        return loss, None
    grad = x.sub_(lse[:, None]).exp_()  # in place over the fp32 copy
    grad[torch.arange(len(target), device=grad.device), target] -= 1.0
    grad.mul_((keep.to(grad.dtype) * scale)[:, None])
    return loss, grad.to(weight.dtype)


def slice_logits_lse(hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
                     ignore_index: int):
    """One chunk of a vocabulary-parallel head (models/lm_head.py): (what `slice_grad_` needs,
    the log-sum-exp of this slice's logits `hidden @ weight.T` over its columns, each row's
    target logit: 0 where `local_targets` is `ignore_index`, the target elsewhere or ignored).
    One fp32 copy of the logits, exponentiated in place (no second chunk-sized tensor)."""
    x = (hidden @ weight.t()).float()
    mine = local_targets != ignore_index
    picked = x.gather(1, local_targets.masked_fill(~mine, 0)[:, None]).squeeze(1) * mine
    row_max = x.max(dim=-1).values
    sums = x.sub_(row_max[:, None]).exp_().sum(dim=-1)
    return (x, row_max), row_max + sums.log(), picked


def slice_grad_(state, lse: torch.Tensor, local_targets: torch.Tensor, keep: torch.Tensor,
                ignore_index: int, scale, dtype):
    """d(loss * scale)/d(this slice's logits) = (softmax - one_hot) * scale on kept rows, 0 on
    ignored ones, from the whole vocabulary's log-sum-exp `lse`, in place over the state of
    `slice_logits_lse`; returned in `dtype`."""
    x, row_max = state  # exp(logits - row_max): times exp(row_max - lse) is the softmax
    grad = x.mul_((row_max - lse).exp_()[:, None])
    rows = (local_targets != ignore_index).nonzero().squeeze(1)
    grad[rows, local_targets[rows]] -= 1.0
    grad.mul_((keep.to(grad.dtype) * scale)[:, None])
    return grad.to(dtype)


def grouped_experts(x, w1, w2, w3, counts, swiglu=swiglu):
    """A mixture of experts' SwiGLU experts, one at a time over their rows of `x` (grouped by
    expert, counts[e] rows for expert e; kernels/grouped.py); `swiglu`: the run's."""
    outs = [F.linear(swiglu(F.linear(rows, w1[e]), F.linear(rows, w3[e])), w2[e])
            for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
