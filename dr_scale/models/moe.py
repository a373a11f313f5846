"""Mixture-of-experts feed-forward: a top-k router (in fp32) over N SwiGLU experts, the experts
computed as grouped matmuls, optional shared experts every token passes through, the router's
auxiliary losses and the load figures users watch.

Why our own layer and not one of DeepSpeed's: `deepspeed.moe.layer.MoE` samples the second
expert with Gumbel noise in its top-2 gate (Mixtral's routing is deterministic), loops over the
experts in Python and is refused under ZeRO-3; AutoEP (0.19.8) replaces the MoE blocks of a
transformers model by matching its config and class names, owns the router, refuses a
load-balancing coefficient, and with transformers 5.25 fails to replace even transformers' own
Mixtral (TypeError in its output-recorder retargeting, 2 gloo ranks, ZeRO-2);
`deepspeed.moe.ep_experts.GroupedExperts` applies DeepSpeed's Triton
SwiGLU in its grouped path unconditionally, so it cannot run CPU tensors. The parameters keep the
layout GroupedExperts and transformers' per-expert checkpoints use (w1 gate, w3 up: experts x
ffn x hidden; w2 down: experts x hidden x ffn), so export and import are a slice per expert.

Experts as grouped matmuls where torch has them (kernels/grouped.py, the op `experts` of the
kernel registry: `model.kernels.experts=loop` forces one expert at a time; on GPUs `auto`
measures both).

Routing (MoEShape): scores are the softmax over the experts (Mixtral, Qwen-MoE) or each
expert's sigmoid (DeepSeek-V3); the top k are chosen, by the scores plus a per-expert bias where
auxiliary-loss-free balancing is on (the bias chooses, never weighs: train/expert_balance.py
moves it); a token's weights are its chosen scores, renormalised to sum to 1 (`route_norm`;
by default only for top_k > 1: a top-1 router whose one weight were always 1 would get no
gradient from the LM loss, so Switch's raw probability is kept), times `route_scale`. The
weighted sum of the experts' rows (the combine) is taken in fp32, as Megatron and torchtitan
do. With `capacity_factor` an expert takes at most ceil(factor x tokens x k / experts) of a
training micro-batch's assignments (the earliest tokens first) and the rest are dropped (the
token keeps its residual); evaluation never drops, so it scores as the exported model does.

The auxiliary losses follow Megatron-core and DeepSeek: each MoE layer's load-balancing loss is
E x sum_e f_e P_e (f_e: the fraction of the layer's assignments expert e received; P_e: its
mean normalised score; 1 when balanced), over each micro-batch or each sequence
(`aux_loss_scope`, DeepSeek-V3's sequence-wise loss), and the layers' losses are summed, each
weighed by `aux_loss_coeff` (as Megatron's moe_aux_loss_coeff); the z-loss likewise.
transformers pools the layers and counts top_k times this at balance: its router_aux_loss_coef
is ours x layers / top_k (the families' configs convert it).
"""
from dataclasses import asdict, dataclass
import math
from typing import Optional

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops

SCORES = ("softmax", "sigmoid")
AUX_SCOPES = ("micro_batch", "sequence")


@dataclass(frozen=True)
class MoEShape:
    """The experts of the decoder blocks (model.moe in the config)."""
    num_experts: int
    top_k: int = 2
    expert_ffn: Optional[int] = None          # an expert's width; None: model.ffn_hidden_size
    shared_experts: int = 0                   # experts every token passes through
    shared_ffn: Optional[int] = None          # their width together; None: shared x expert's
    shared_gate: bool = False                 # a sigmoid gate on the shared output (Qwen-MoE)
    dense_layers: int = 0                     # the first blocks keep a dense MLP (DeepSeek)
    score: str = "softmax"                    # or "sigmoid" (DeepSeek-V3)
    route_norm: Optional[bool] = None         # None: renormalise the top k when top_k > 1
    route_scale: float = 1.0                  # the routed output's scale (DeepSeek-V3: 2.5)
    bias_update_rate: float = 0.0             # auxiliary-loss-free balancing step (0: off)
    expert_bias: Optional[bool] = None        # the routing has a bias, saved and exported;
                                              # None: where balancing is on
    capacity_factor: Optional[float] = None   # None (or 0): drop-free; training only
    aux_loss_coeff: float = 0.01              # load balancing, per MoE layer, summed
    aux_loss_scope: str = "micro_batch"       # or "sequence"
    z_loss_coeff: float = 0.001               # router z-loss (ST-MoE), per MoE layer, summed

    @classmethod
    def parse(cls, value, source: str = "model.moe") -> Optional["MoEShape"]:
        if value is None or isinstance(value, cls):
            return value
        try:
            shape = cls(**{k: v for k, v in dict(value).items() if v is not None})
        except TypeError as e:
            raise DrScaleError(f"{source}: {e}") from None
        if shape.num_experts < 1 or not 1 <= shape.top_k <= shape.num_experts:
            raise DrScaleError(f"{source}: top_k={shape.top_k} must be between 1 and "
                               f"num_experts={shape.num_experts}")
        if shape.capacity_factor is not None and shape.capacity_factor < 0:
            raise DrScaleError(f"{source}.capacity_factor={shape.capacity_factor}: expected a "
                               "positive number, or null (0) for drop-free routing")
        for key, allowed in (("score", SCORES), ("aux_loss_scope", AUX_SCOPES)):
            if getattr(shape, key) not in allowed:
                raise DrScaleError(f"{source}.{key}={getattr(shape, key)!r}: expected one of "
                                   f"{', '.join(allowed)}")
        if shape.capacity_factor == 0:
            object.__setattr__(shape, "capacity_factor", None)
        if shape.route_norm is None:
            object.__setattr__(shape, "route_norm", shape.top_k > 1)
        if shape.expert_bias is None:
            object.__setattr__(shape, "expert_bias", shape.bias_update_rate > 0)
        elif shape.bias_update_rate > 0 and not shape.expert_bias:
            raise DrScaleError(f"{source}.bias_update_rate={shape.bias_update_rate} moves the "
                               "routing's bias, which expert_bias=false leaves out; set "
                               "expert_bias to true or the rate to 0")
        return shape

    def to_dict(self) -> dict:
        return asdict(self)

    def expert_width(self, ffn_hidden_size: int) -> int:
        return self.expert_ffn or ffn_hidden_size

    def shared_width(self, ffn_hidden_size: int) -> int:
        return self.shared_ffn or self.shared_experts * self.expert_width(ffn_hidden_size)

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.dense_layers


class Router(nn.Module):
    """The gate: one logit per expert, computed in fp32 whatever the model's dtype (a bf16
    softmax over near-equal logits picks experts by rounding). `expert_bias` (fp32) is added to
    the scores to choose the experts, never to weigh them: auxiliary-loss-free balancing
    (train/expert_balance.py) moves it. Where the routing has one (`saved`) it is saved with the
    weights and exported; elsewhere it stays zeros and out of the checkpoints."""

    def __init__(self, hidden: int, num_experts: int, saved: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # from numpy: DeepSpeed's zero.Init replaces torch's constructors (bf16, on its device)
        self.register_buffer("expert_bias", torch.from_numpy(np.zeros(num_experts, np.float32)),
                             persistent=saved)

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())

    def init_buffers(self):
        """The bias for a model built on the meta device (zeros until balancing moves it)."""
        self.expert_bias = torch.from_numpy(np.zeros(self.weight.shape[0], np.float32))

    def _apply(self, fn, recurse=True):
        """A cast of the module (`model.bfloat16()`) leaves the bias fp32: its steps are far
        below bf16's resolution near the scores."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32 and not bias.is_meta:
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    def initial_rule(self, attr, std, out_std):
        return ("normal", std)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def initial_rule(self, attr, std, out_std):
        """w2 writes into the residual stream: scaled as the dense down projection is."""
        return ("normal", out_std if attr == "w2" else std)

    def forward(self, x, counts):
        """`x`: the routed rows grouped by expert, `counts[e]` rows for expert e; the kernel
        chosen for op `experts` (kernels/grouped.py: grouped matmuls, or a loop)."""
        return ops.grouped_experts(x, self.w1, self.w2, self.w3, counts)


@dataclass
class RouterStats:
    """One block's routing over its last micro-batch (tensors, detached but the losses)."""
    aux_loss: torch.Tensor        # E x sum_e f_e P_e: 1 when balanced
    z_loss: torch.Tensor          # mean over tokens of logsumexp(logits)^2
    tokens_per_expert: torch.Tensor  # assignments each expert received (before drops)
    dropped: torch.Tensor         # assignments dropped by the capacity


class SparseMoE(nn.Module):
    """The feed-forward of a MoE decoder block (transformers' names: `gate`, `experts`;
    `shared_experts` and `shared_gate` where the shape has them)."""

    def __init__(self, hidden: int, ffn: int, moe: MoEShape):
        """`ffn`: the model's dense MLP width (an expert's where moe.expert_ffn is unset)."""
        super().__init__()
        from dr_scale.models.layers import SwiGLU

        self.moe = moe
        self.gate = Router(hidden, moe.num_experts, saved=moe.expert_bias)
        self.experts = Experts(moe.num_experts, hidden, moe.expert_width(ffn))
        if moe.shared_experts or moe.shared_ffn:
            self.shared_experts = SwiGLU(hidden, moe.shared_width(ffn))
            if moe.shared_gate:
                self.shared_gate = nn.Linear(hidden, 1, bias=False)
        self.stats: Optional[RouterStats] = None

    def route(self, x):
        """(logits, scores, chosen experts (T, k), their weights (T, k)), fp32."""
        moe = self.moe
        logits = self.gate(x)                                    # (T, E) fp32
        scores = torch.softmax(logits, -1) if moe.score == "softmax" else torch.sigmoid(logits)
        chosen = torch.topk(scores + self.gate.expert_bias, moe.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if moe.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, scores, chosen, weights * moe.route_scale

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k, num_experts = x.shape[0], self.moe.top_k, self.moe.num_experts
        logits, scores, chosen, weights = self.route(x)

        flat = chosen.reshape(-1)                                # assignment a: token a // k
        order = torch.argsort(flat, stable=True)                 # grouped by expert, tokens in order
        # (not bincount, which on a GPU waits for the largest index)
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        if self.moe.capacity_factor is not None and self.training:
            capacity = math.ceil(self.moe.capacity_factor * tokens * k / num_experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            order = order[position < capacity]
            kept = torch.clamp(counts, max=capacity)
        else:
            kept = counts
        token = order // k
        rows = self.experts(x[token], kept)
        # the combine in fp32 (one upcast of the routed rows), cast once at the end
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(
            0, token, rows.float() * weights.reshape(-1)[order, None])
        out = out.to(x.dtype)
        if hasattr(self, "shared_experts"):
            shared = self.shared_experts(x)
            if hasattr(self, "shared_gate"):
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared

        self.stats = RouterStats(
            aux_loss=self._balance_loss(scores, chosen, shape),
            z_loss=torch.logsumexp(logits, dim=-1).square().mean(),
            tokens_per_expert=counts.detach(),
            dropped=(counts - kept).sum().detach())
        return out.view(shape)

    def _balance_loss(self, scores, chosen, shape):
        """E x sum_e f_e P_e over the micro-batch, or over each sequence and then averaged."""
        num_experts, k = self.moe.num_experts, self.moe.top_k
        probs = scores if self.moe.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        if self.moe.aux_loss_scope == "sequence" and len(shape) == 3:
            batch, seq = shape[0], shape[1]
        else:
            batch, seq = 1, scores.shape[0]
        probs = probs.view(batch, seq, num_experts)
        assigned = torch.zeros(batch, num_experts, device=scores.device).scatter_add_(
            1, chosen.view(batch, seq * k), torch.ones(batch, seq * k, device=scores.device))
        f = assigned / (seq * k)
        return (num_experts * (f * probs.mean(1)).sum(-1)).mean()


def router_losses(blocks, moe: MoEShape):
    """(the coefficient-weighted sum over the MoE layers of the router losses, to add to the LM
    loss; the figures for the loss line, each layer's losses averaged there) from the last
    forward of each SparseMoE in `blocks` (dense blocks are skipped)."""
    stats = [m.stats for m in blocks if isinstance(m, SparseMoE) and m.stats is not None]
    if not stats:
        return None, {}
    aux = torch.stack([s.aux_loss for s in stats])
    z = torch.stack([s.z_loss for s in stats])
    counts = torch.stack([s.tokens_per_expert.float() for s in stats])  # (layers, experts)
    figures = {"aux_loss": aux.mean().detach(), "z_loss": z.mean().detach(),
               "tokens_dropped": torch.stack([s.dropped for s in stats]).float().sum()
               / counts.sum(),
               # per layer: the busiest expert's assignments over the mean (1: balanced)
               "expert_load": counts.max(dim=1).values / counts.mean(dim=1)}
    return moe.aux_loss_coeff * aux.sum() + moe.z_loss_coeff * z.sum(), figures
