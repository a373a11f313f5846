"""Gradient-norm monitor: on each logged step, the global norm of the reduced gradients and the
parameters with the largest whole-parameter norms (ZeRO shards combined), before any clipping.

    callbacks:
      grad_norm_monitor: {enabled: true, top_k: 5}

Training records then carry `grad_norm_total` and `grad_norm_top` ([[name, norm], ...]).
"""
from dr_scale.compat.grads import grad_norms, local_grads
from dr_scale.registry import CALLBACK_REGISTRY
from dr_scale.train.callbacks import Callback


@CALLBACK_REGISTRY.register("grad_norm_monitor")
class GradNormMonitor(Callback):
    order = -10  # before per_layer_clip in the same after_backward: it sees unclipped gradients

    def __init__(self, top_k: int = 5):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise TypeError(f"top_k: expected an integer >= 1, got {top_k!r}")
        self.top_k = top_k

    def after_backward(self, trainer, step, micro_step):
        if micro_step != trainer.layout["accum"] - 1 or not trainer.will_log(step + 1):
            return  # only at the boundary of a step whose record is written
        grads = local_grads(trainer.engine)
        norms = grad_norms(trainer.engine, grads)
        values, index = norms.topk(min(self.top_k, len(grads)))
        trainer.report("grad_norm_total", norms.pow(2).sum().sqrt())
        trainer.report("grad_norm_top", [[grads[i].name, v]
                                         for i, v in zip(index.tolist(), values.tolist())])
