"""Auxiliary-loss-free load balancing (DeepSeek-V3): each MoE block's router keeps a bias per
expert, added to the scores only to choose the experts (models/moe.py); before every optimizer
step each bias moves by `model.moe.bias_update_rate` toward the mean load: up for an expert that
received fewer than the mean of the step's assignments, down for one that received more.

The load is the whole step's: every micro-batch of the accumulation on every data-parallel rank
(one all-reduce of layers x experts counts a step), so every rank moves the same biases by the
same amount, whatever the layout; a run on one rank and one on several (expert parallel or not)
with the same global batch route alike. Tensor-parallel ranks see the same tokens and are not
counted twice (the data-parallel group leaves them out).

The biases are buffers of the model (saved with its weights, exported as transformers'
e_score_correction_bias); the counts of a step in progress are not state: a checkpoint is
taken between steps.
"""
from typing import List, Optional

import torch

from dr_scale.models.moe import SparseMoE
from dr_scale.runtime import comm


class ExpertBalance:
    def __init__(self, blocks: List[SparseMoE], rate: float, group):
        self.blocks, self.rate, self.group = blocks, rate, group
        self.load: Optional[torch.Tensor] = None  # (layers, experts) this step, this rank

    @classmethod
    def of(cls, model, topology, data_group) -> Optional["ExpertBalance"]:
        """The balancing of `model`'s MoE blocks where its shape asks for it, else None."""
        moe = getattr(model.shape, "moe", None)
        if moe is None or not moe.bias_update_rate:
            return None
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        return cls(blocks, moe.bias_update_rate, data_group if topology.world > 1 else None)

    def after_backward(self):
        """A micro-batch done: its assignments per expert, by block (the last forward's: under
        activation checkpointing the recomputation routes the same)."""
        counts = torch.stack([b.stats.tokens_per_expert for b in self.blocks]).float()
        self.load = counts if self.load is None else self.load + counts

    def before_update(self):
        """The step's load over every data-parallel rank, and each bias moved by the rate."""
        load, self.load = self.load, None
        if load is None:
            return
        if self.group is not None:
            comm.all_reduce(load, group=self.group)
        moves = self.rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
        with torch.no_grad():
            for block, move in zip(self.blocks, moves):
                bias = block.gate.expert_bias
                bias.add_(move.to(bias.device))
