"""Gradient-norm monitor: on each logged step, the global norm of the reduced gradients and the
parameters with the largest whole-parameter norms (ZeRO shards combined), before any clipping.

    callbacks:
      grad_norm_monitor: {enabled: true, top_k: 5}

Training records then carry `grad_norm_total` and `grad_norm_top` ([[name, norm], ...]).
"""
from dataclasses import dataclass

from dr_scale.callbacks.base import Callback
from dr_scale.callbacks.per_layer_clip import BETWEEN_BACKWARD_AND_STEP, READS_REDUCED_GRADIENTS
from dr_scale.compat.grads import grad_norms, local_grads
from dr_scale.config.typed import Section, field
from dr_scale.registry import CALLBACK_REGISTRY


@dataclass
class GradNormMonitorOptions(Section):
    top_k: int = field(5, min=1, help="how many of the largest per-parameter norms to record")


@CALLBACK_REGISTRY.register("grad_norm_monitor")
class GradNormMonitor(Callback):
    name = "grad_norm_monitor"
    Options = GradNormMonitorOptions
    not_with_pipeline = BETWEEN_BACKWARD_AND_STEP
    not_with_muon = READS_REDUCED_GRADIENTS
    order = -10  # before per_layer_clip in the same after_backward: it sees unclipped gradients

    def __init__(self, top_k: int = 5):
        self.top_k = self.options(top_k=top_k).top_k

    def after_backward(self, trainer, step, micro_step):
        if micro_step != trainer.batch_sizes["accum"] - 1 or not trainer.will_log(step + 1):
            return  # only at the boundary of a step whose record is written
        grads = local_grads(trainer.engine, trainer.topology)
        norms = grad_norms(trainer.engine, grads, trainer.topology)
        values, index = norms.topk(min(self.top_k, len(grads)))
        trainer.report("grad_norm_total", norms.pow(2).sum().sqrt())
        trainer.report("grad_norm_top", [[grads[i].name, v]
                                         for i, v in zip(index.tolist(), values.tolist())])
