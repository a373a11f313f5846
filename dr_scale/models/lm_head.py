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
torch has no fused op. This is plain torch, so it runs on every device and under ZeRO-3 (the
head's weight is gathered by the module's forward hooks, which is why the loss is computed inside
`LMHead.forward`). Under tensor parallelism DeepSpeed replaces the head by its vocabulary-parallel
layer and the model falls back to logits and DeepSpeed's vocabulary-parallel loss; a pipeline's
last stage computes logits and then its loss (parallel/pipeline.py).
"""
import torch
from torch import nn

# Chunks hold at most this many bytes of fp32 logits (the largest transient of the loss).
CHUNK_BYTES = 256 * 2 ** 20
IGNORE_INDEX = -100


def chunk_tokens(vocab_size: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit `budget` (at least 16)."""
    tokens = max(16, budget // (4 * vocab_size))
    return 1 << (tokens.bit_length() - 1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        counted = y != ignore_index
        n = counted.sum().clamp(min=1)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        # summed in fp32 over the chunks, as the unfused matmul accumulates over all tokens
        # (summing a bf16 weight's gradient in bf16 in place, with addmm, saved 0.1 GiB of the
        # 7.4 GiB peak and made the step 1.6x slower on CPU: benchmarks/lm_head_loss.py)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc, yc, keep = h[start:start + chunk], y[start:start + chunk], counted[start:start + chunk]
            logits = (hc @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            target = yc.masked_fill(~keep, 0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * keep).sum()
            if not (want_h or want_w):
                continue
            # d(mean loss)/d(logits) = (softmax - one_hot) / n, in place over the chunk's logits
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(yc), device=grad.device), target] -= 1.0
            grad.mul_((keep.to(grad.dtype) / n)[:, None])
            grad = grad.to(weight.dtype)
            if want_h:
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
                None, None, None)


def linear_cross_entropy(hidden, weight, labels, chunk: int, ignore_index: int = IGNORE_INDEX):
    """Mean cross-entropy (fp32) of `hidden @ weight.T` against `labels`, `chunk` tokens at a
    time; tokens labelled `ignore_index` are left out of the mean."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, ignore_index)


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
