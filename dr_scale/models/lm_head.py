"""The LM head and its cross-entropy, fused and chunked over tokens: the (tokens x vocabulary)
logits are never whole.

For each chunk of tokens the forward computes that chunk's logits, its loss and, when a gradient
will be wanted, the chunk's gradients for the hidden states and the head's weight (softmax minus
the one-hot target, times the weight or the hidden states). Backward then only scales what the
forward kept by the incoming gradient. The matmuls are the ones the unfused path does (one
forward, two backward), so the step does no extra work; what goes is the whole logits tensor,
its fp32 copy, the log-softmax autograd keeps and their gradients: at a 128,256 vocabulary and
4,096 tokens per micro-batch about 8 GiB in fp32 (benchmarks/lm_head_loss.py measures it).

Why not a library's: Liger-Kernel's FusedLinearCrossEntropy does this in Triton for CUDA only;
torch has no fused op. The chunking and matmuls are plain torch, so they run on every device and
under ZeRO-3 (the head's weight is gathered by the module's forward hooks, which is why the loss
is computed inside `LMHead.forward`). Each chunk's softmax, loss and gradient go through the
run's cross-entropy kernel (`model.kernels`, kernels/ops.py): torch makes an fp32 copy of the
chunk and passes over it five times; Triton (on a GPU where `auto` measures it faster at the
chunk's shape, kernels/measured.py) reads the 16-bit logits twice and writes their gradient over
them. Why that can pay (arithmetic, not yet measured on a GPU): per logit the three matmuls do
6 x hidden FLOPs, the torch path moves ~34 bytes and Triton's ~8; at a hidden size of 768 on an
H200 (989 TFLOP/s, 4.8 TB/s) that is ~4.7 ps of matmul against ~7 and ~1.7 ps of memory traffic.
Under tensor parallelism DeepSpeed replaces the head by its vocabulary-parallel layer, which
computes the same fused loss over its slice of the vocabulary (fuse_vocab_parallel_head): the
kernel gives each slice's log-sum-exp and target logits, two small all-reduces a chunk make them
the whole vocabulary's, and the kernel writes the slice's gradient from them; a pipeline's
last stage computes logits and then its loss (parallel/pipeline.py).
"""
import torch
from torch import nn

from dr_scale.kernels import ops

# Chunks hold at most this many bytes of fp32 logits (the largest transient of the loss).
CHUNK_BYTES = 256 * 2 ** 20
IGNORE_INDEX = -100


def chunk_tokens(vocab_size: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit `budget` (at least 16)."""
    tokens = max(16, budget // (4 * vocab_size))
    return 1 << (tokens.bit_length() - 1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int, group=None,
                vocab_start: int = 0, grad_wanted: bool = True):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        counted = y != ignore_index
        n = counted.sum().clamp(min=1)
        # needs_input_grad says what the inputs require, also under torch.no_grad() where no
        # backward will come (evaluation); `grad_wanted` is the caller's grad mode (inside
        # forward it is always off): without it no gradient is computed or kept
        want_h = grad_wanted and ctx.needs_input_grad[0]
        want_w = grad_wanted and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        # summed in fp32 over the chunks, as the unfused matmul accumulates over all tokens
        # (summing a bf16 weight's gradient in bf16 in place, with addmm, saved 0.1 GiB of the
        # 7.4 GiB peak and made the step 1.6x slower on CPU: benchmarks/lm_head_loss.py)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc, yc, keep = h[start:start + chunk], y[start:start + chunk], counted[start:start + chunk]
            if group is None:
                # the chunk's loss and d(mean loss)/d(logits) = (softmax - one_hot) / n, by the
                # run's cross-entropy kernel (torch, or Triton over the 16-bit logits in place)
                loss, grad = ops.cross_entropy_chunk(hc, weight, yc, ignore_index, 1.0 / n,
                                                     want_h or want_w)
                total += loss
                if grad is None:
                    continue
            else:
                # this slice's log-sum-exp and target logits, combined over the tensor group
                local = torch.where(keep, yc - vocab_start, ignore_index)
                local = local.masked_fill((local < 0) | (local >= weight.shape[0]), ignore_index)
                state, lse, picked = ops.slice_logits_lse(hc, weight, local, ignore_index)
                lse, picked = _whole_vocabulary(lse, picked, group)
                total += ((lse - picked) * keep).sum()
                if not (want_h or want_w):
                    continue
                grad = ops.slice_grad_(state, lse, local, keep, ignore_index, 1.0 / n,
                                       weight.dtype)
            if want_h:  # under TP, this slice's share: the caller's ColumnParallel sums them
                torch.mm(grad, weight, out=grad_h[start:start + chunk])
            if want_w:
                if hc.dtype == grad_w.dtype:
                    grad_w.addmm_(grad.t(), hc)
                else:
                    grad_w.add_(grad.t() @ hc)
        ctx.grads = (None if grad_h is None else grad_h.view_as(hidden),
                     None if grad_w is None else grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # in place: the kept gradients are this function's own (no second copy of V x d)
        return (None if grad_h is None else grad_h.mul_(grad_out.to(grad_h.dtype)),
                None if grad_w is None else grad_w.mul_(grad_out.to(grad_w.dtype)),
                None, None, None, None, None, None)


def _whole_vocabulary(lse, picked, group):
    """The whole vocabulary's log-sum-exp and target logit per row from each slice's (the target
    logit is nonzero in one slice only): the maximum, then the exp-sums and target logits summed
    over the tensor group, two small all-reduces a chunk."""
    from dr_scale.runtime import comm

    top = lse.clone()
    comm.all_reduce(top, "max", group=group)
    sums = torch.stack([(lse - top).exp(), picked])
    comm.all_reduce(sums, group=group)
    return top + sums[0].log(), sums[1]


def linear_cross_entropy(hidden, weight, labels, chunk: int, ignore_index: int = IGNORE_INDEX,
                         group=None, vocab_start: int = 0):
    """Mean cross-entropy (fp32) of `hidden @ weight.T` against `labels`, `chunk` tokens at a
    time; tokens labelled `ignore_index` are left out of the mean. With a tensor `group`,
    `weight` is this rank's rows [vocab_start, ...) of a vocabulary-parallel head: the loss is
    the whole vocabulary's, and the hidden states' gradient this slice's share (sum it over the
    group: DeepSpeed's ColumnParallel does, in fuse_vocab_parallel_head)."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, ignore_index, group,
                                     vocab_start, torch.is_grad_enabled())


def fuses_loss(head) -> bool:
    """Whether the model hands `head` its labels for the fused loss (ours with a chunk, or
    DeepSpeed's vocabulary-parallel head after fuse_vocab_parallel_head)."""
    if isinstance(head, LMHead):
        return head.fuses_loss()
    return getattr(head, "dr_loss_chunk", 0) > 0


def logits_or_loss(model, x, labels=None):
    """The tail every family's forward shares: the head's logits (under tensor parallelism a
    vocabulary slice), or with labels the mean cross-entropy: fused with the head where it fuses
    (never whole logits), else the model's `loss_function` on the logits."""
    if labels is not None and fuses_loss(model.lm_head):
        return model.lm_head(x, labels)
    logits = model.lm_head(x)
    if labels is None:
        return logits
    return model.loss_function(logits, shift_labels=labels)


def fuse_vocab_parallel_head(head, chunk: int, input_grads_summed: bool = False):
    """Make DeepSpeed's vocabulary-parallel head (a column-parallel slice of the vocabulary)
    compute the fused chunked loss when given labels: no rank then holds its logits slice for
    the whole micro-batch. The forward is replaced on the instance, so the module's hooks (ZeRO-3
    gathering its weight, sequence parallelism gathering its input) still run around it; given no
    labels it is the forward it had. `input_grads_summed`: the caller's collective already sums
    the input's gradient over the group (sequence parallelism's gather); else DeepSpeed's
    ColumnParallel does."""
    from deepspeed.module_inject.layers import ColumnParallel

    plain = head.forward

    def forward(x, labels=None):
        if labels is None:
            return plain(x)
        if not input_grads_summed:
            x = ColumnParallel.apply(head.mp_group, x)
        return linear_cross_entropy(x, head.weight, labels, chunk, group=head.mp_group,
                                    vocab_start=head.vocab_start_index)
    head.forward = forward
    head.dr_loss_chunk = chunk


class LMHead(nn.Linear):
    """The output projection (a plain nn.Linear by name and weights: exports, AutoTP and
    initialisation see one); given labels, it returns the fused chunked loss instead of logits.
    `chunk` 0 keeps the logits whole (the model then applies its loss_function)."""

    def __init__(self, hidden_size: int, vocab_size: int, chunk: int):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk = chunk

    def forward(self, x, labels=None):
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, labels, self.chunk)

    def fuses_loss(self) -> bool:
        return self.chunk > 0
