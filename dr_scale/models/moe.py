"""Mixture-of-experts feed-forward: a top-k router (in fp32) over N SwiGLU experts, the experts
computed as grouped matmuls, the router's auxiliary losses and the load figures users watch.

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

Routing, Mixtral's: softmax over all experts, the top k kept and renormalised to sum to 1. With
`capacity_factor` an expert takes at most ceil(factor x tokens x k / experts) of a micro-batch's
assignments (the earliest tokens first) and the rest are dropped (the token keeps its residual);
without it nothing is dropped.
"""
from dataclasses import asdict, dataclass
import math
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops


@dataclass(frozen=True)
class MoEShape:
    """The experts of every decoder block (model.moe in the config)."""
    num_experts: int
    top_k: int = 2
    capacity_factor: Optional[float] = None  # None (or 0): drop-free
    aux_loss_coeff: float = 0.01              # load balancing (Switch / Mixtral), per layer
    z_loss_coeff: float = 0.001               # router z-loss (ST-MoE), per layer

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
        if shape.capacity_factor == 0:
            object.__setattr__(shape, "capacity_factor", None)
        return shape

    def to_dict(self) -> dict:
        return asdict(self)


class Router(nn.Module):
    """The gate: one logit per expert, computed in fp32 whatever the model's dtype (a bf16
    softmax over near-equal logits picks experts by rounding)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())

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
    """The feed-forward of a MoE decoder block (transformers' names: `gate`, `experts`)."""

    def __init__(self, hidden: int, ffn: int, moe: MoEShape):
        super().__init__()
        self.moe = moe
        self.gate = Router(hidden, moe.num_experts)
        self.experts = Experts(moe.num_experts, hidden, ffn)
        self.stats: Optional[RouterStats] = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k, num_experts = x.shape[0], self.moe.top_k, self.moe.num_experts
        logits = self.gate(x)                                    # (T, E) fp32
        probs = torch.softmax(logits, dim=-1)
        top, chosen = torch.topk(probs, k, dim=-1)               # (T, k)
        weights = top / top.sum(dim=-1, keepdim=True)

        flat = chosen.reshape(-1)                                # assignment a: token a // k
        order = torch.argsort(flat, stable=True)                 # grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=num_experts)
        keep = None
        if self.moe.capacity_factor is not None:
            capacity = math.ceil(self.moe.capacity_factor * tokens * k / num_experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            keep = position < capacity
            order = order[keep]
            kept = torch.clamp(counts, max=capacity)
        else:
            kept = counts
        token = order // k
        rows = self.experts(x[token], kept)
        # weighted in the rows' dtype: in bf16 the fp32 round trip (transformers' way) costs two
        # copies of the routed rows each way, ~6% of a moe_tiny block's step on a CPU
        out = torch.zeros_like(x).index_add_(
            0, token, rows * weights.reshape(-1)[order, None].to(rows.dtype))

        self.stats = RouterStats(
            aux_loss=num_experts * torch.sum(probs.mean(0) * counts.float() / (tokens * k)),
            z_loss=torch.logsumexp(logits, dim=-1).square().mean(),
            tokens_per_expert=counts.detach(),
            dropped=(counts - kept).sum().detach())
        return out.view(shape)


def router_losses(blocks, moe: MoEShape):
    """(the coefficient-weighted sum of the router losses to add to the LM loss, the figures
    for the loss line) from the last forward of each SparseMoE in `blocks`."""
    stats = [m.stats for m in blocks if m.stats is not None]
    if not stats:
        return None, {}
    aux = torch.stack([s.aux_loss for s in stats]).mean()
    z = torch.stack([s.z_loss for s in stats]).mean()
    counts = torch.stack([s.tokens_per_expert.float() for s in stats])  # (layers, experts)
    figures = {"aux_loss": aux.detach(), "z_loss": z.detach(),
               "tokens_dropped": torch.stack([s.dropped for s in stats]).float().sum()
               / counts.sum(),
               # per layer: the busiest expert's assignments over the mean (1: balanced)
               "expert_load": counts.max(dim=1).values / counts.mean(dim=1)}
    return moe.aux_loss_coeff * aux + moe.z_loss_coeff * z, figures
