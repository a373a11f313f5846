"""nan_guard: non-finite losses and gradients are caught, the step skipped, the first offending
parameter named; after `max_consecutive` bad steps in a row the run stops, its last good
checkpoint intact.

DeepSpeed already refuses an optimizer step whose global gradient norm is not finite (every ZeRO
stage, bf16 included: `check_grad_overflow`), without stepping the LR schedule; this callback
watches for that, finds which parameter went bad, logs it and counts. Finding the parameter uses
a hook per parameter that records, on the device and without a host sync, whether its local
gradient was finite; the flags are reduced across ranks only when a step was skipped. Forward
hooks do the same for module outputs (`trace_outputs`), naming the first module, in the order
modules finished, whose output was not finite: where a NaN was born rather than where it ended.
"""
import functools
from dataclasses import dataclass

import torch

from dr_scale.runtime import comm
from dr_scale.callbacks.base import Callback
from dr_scale.config.typed import Section, field
from dr_scale.errors import TrainingStopped
from dr_scale.registry import CALLBACK_REGISTRY


class NonFiniteOutputs:
    """Forward hooks that flag, on the device, modules whose output holds a NaN or Inf."""

    def __init__(self, model: torch.nn.Module, device):
        self.names = [n or "<model>" for n, _ in model.named_modules()]
        self.flags = torch.zeros(len(self.names), device=device)
        self.finish_order = []  # module indices in the order their forward finished, first pass
        self._seen = set()
        self.handles = [m.register_forward_hook(functools.partial(self._check, i))
                        for i, (_, m) in enumerate(model.named_modules())]

    def _check(self, i, module, args, output):
        if i not in self._seen:
            self._seen.add(i)
            self.finish_order.append(i)
        t = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad = (~torch.isfinite(t.detach()).all()).float().to(self.flags.device)
            self.flags[i] = torch.maximum(self.flags[i], bad)

    def first(self, flags=None):
        """Name of the first module (in finishing order) flagged, or None."""
        flags = (self.flags if flags is None else flags).tolist()
        return next((self.names[i] for i in self.finish_order if flags[i]), None)

    def remove(self):
        for h in self.handles:
            h.remove()


@dataclass
class NanGuardOptions(Section):
    max_consecutive: int = field(3, min=1, help="stop after this many skipped steps in a row")
    trace_outputs: bool = field(True, help="name the first module whose output went bad")


@CALLBACK_REGISTRY.register("nan_guard")
class NanGuard(Callback):
    name = "nan_guard"
    Options = NanGuardOptions

    def __init__(self, max_consecutive: int = 3, trace_outputs: bool = True):
        o = self.options(max_consecutive=max_consecutive, trace_outputs=trace_outputs)
        self.max_consecutive = o.max_consecutive
        self.trace_outputs = o.trace_outputs
        self.outputs = None
        self.consecutive = 0
        self.skipped_total = 0

    def on_train_start(self, trainer):
        params = [(n, p) for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in params]
        self.bad = torch.zeros(len(params) + 1, device=trainer.device)  # last slot: the loss
        for i, (_, p) in enumerate(params):
            p.register_hook(functools.partial(self._check_grad, i))
        self.skipped_before = trainer.engine.skipped_steps
        if self.trace_outputs:
            self.outputs = NonFiniteOutputs(trainer.engine.module, trainer.device)

    def _check_grad(self, i, grad):
        self.bad[i] = torch.maximum(self.bad[i], (~torch.isfinite(grad).all()).float())

    def after_backward(self, trainer, step, micro_step):
        loss = trainer.last_loss
        self.bad[-1] = torch.maximum(self.bad[-1], (~torch.isfinite(loss).all()).float().to(self.bad.device))

    def after_step(self, trainer, step, record):
        skipped = trainer.engine.skipped_steps > self.skipped_before
        self.skipped_before = trainer.engine.skipped_steps
        if not skipped:
            self.consecutive = 0
            self.bad.zero_()
            if self.outputs is not None:
                self.outputs.flags.zero_()
            return
        comm.all_reduce(self.bad, "max")
        flags = self.bad.tolist()
        first = next((self.names[i] for i, f in enumerate(flags[:-1]) if f), None)
        what = ("non-finite loss" if flags[-1] else "non-finite gradient") + \
            (f", first non-finite gradient: {first}" if first else "")
        if self.outputs is not None:
            comm.all_reduce(self.outputs.flags, "max")
            module = self.outputs.first()
            what += f", first non-finite output: {module}" if module else ""
            self.outputs.flags.zero_()
        self.consecutive += 1
        self.skipped_total += 1
        trainer.logger.log_event({"step": step, "skipped_step": True, "reason": what,
                                  "consecutive": self.consecutive})
        self.bad.zero_()
        if self.consecutive >= self.max_consecutive:
            last = trainer.last_checkpoint or "none yet"
            raise TrainingStopped(
                f"nan_guard: {self.consecutive} non-finite steps in a row (last at step {step}: "
                f"{what}); stopped without saving; last good checkpoint: {last}")

    def state_dict(self):
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total}

    def load_state_dict(self, state):
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
