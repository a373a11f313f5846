"""Per-layer gradient clipping: each parameter's gradient scaled to at most `max_norm` by its own
whole-parameter norm (not its ZeRO shard's), parameters matching `exempt` left alone.

Runs at the accumulation boundary, after DeepSpeed has reduced the gradients and before its
optimizer step, so DeepSpeed's global clipping (`train.grad_clip`) still applies after it; set
that to 0 to clip per layer only.

    callbacks:
      per_layer_clip: {enabled: true, max_norm: 1.0, exempt: ["*bias", "*norm*"]}
"""
import fnmatch
from dataclasses import dataclass
from typing import List, Sequence

import torch

from dr_scale.callbacks.base import Callback
from dr_scale.compat.grads import grad_norms, local_grads, scale_
from dr_scale.config.typed import Section, field
from dr_scale.registry import CALLBACK_REGISTRY

DEFAULT_EXEMPT = ("*bias", "*norm*", "*.ln_*")

# DeepSpeed's ZeRO writes Muon's orthogonalised update where the reduced gradient was, before
# the step (parallel/muon.py): what these callbacks would read and scale is not a gradient
READS_REDUCED_GRADIENTS = ("DeepSpeed's ZeRO keeps Muon's orthogonalised update where the "
                           "reduced gradient was, so it would act on updates, not gradients")
BETWEEN_BACKWARD_AND_STEP = ("it acts between backward and the optimizer step, which DeepSpeed's "
                             "pipeline engine runs in one call")


def exempt_mask(names: Sequence[str], patterns: Sequence[str]) -> List[bool]:
    return [any(fnmatch.fnmatchcase(n, pat) for pat in patterns) for n in names]


def clip_factors(norms: torch.Tensor, max_norm: float, exempt: torch.Tensor) -> torch.Tensor:
    """min(1, max_norm / norm) per parameter; 1 for exempt ones."""
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(exempt, torch.ones_like(factors), factors)


def clip_per_layer_(engine, max_norm: float, patterns: Sequence[str], topology):
    """Clip this step's reduced gradients in place. Returns (norms, factors), equal on all ranks."""
    grads = local_grads(engine, topology)
    norms = grad_norms(engine, grads, topology)
    exempt = torch.tensor(exempt_mask([g.name for g in grads], patterns), device=norms.device)
    factors = clip_factors(norms, max_norm, exempt)
    scale_(grads, factors)
    return norms, factors


@dataclass
class PerLayerClipOptions(Section):
    max_norm: float = field(1.0, min=1e-12, help="each parameter's gradient norm at most this")
    exempt: List[str] = field(factory=lambda: list(DEFAULT_EXEMPT),
                              help="name patterns (fnmatch) left unclipped")


@CALLBACK_REGISTRY.register("per_layer_clip")
class PerLayerClip(Callback):
    name = "per_layer_clip"
    Options = PerLayerClipOptions
    not_with_pipeline = BETWEEN_BACKWARD_AND_STEP
    not_with_muon = READS_REDUCED_GRADIENTS

    def __init__(self, max_norm: float = 1.0, exempt: Sequence[str] = DEFAULT_EXEMPT):
        o = self.options(max_norm=max_norm, exempt=list(exempt) if isinstance(
            exempt, (list, tuple)) else exempt)
        self.max_norm, self.exempt = o.max_norm, list(o.exempt)

    def after_backward(self, trainer, step, micro_step):
        if micro_step != trainer.batch_sizes["accum"] - 1:
            return  # gradients are reduced only at the accumulation boundary
        _, factors = clip_per_layer_(trainer.engine, self.max_norm, self.exempt,
                                      trainer.topology)
        trainer.report("clipped_params", (factors < 1).sum().float())  # mean over the window
