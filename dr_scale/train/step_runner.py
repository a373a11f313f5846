"""One optimizer step, and one held-out loss, by engine kind: chosen once from the Topology
(`for_topology`), so the trainer's loop keeps only the cadence (log, evaluate, save, signals).

    PlainSteps     DeepSpeed's engine: forward, backward and the callbacks' after_backward for
                   each micro-batch of the accumulation, the optimizer step at its end
    PipelineSteps  DeepSpeed's pipeline engine: `train_batch` runs the step's micro-batches
                   through the stages and steps the optimizer inside (the callbacks that must
                   run between backward and step are refused under a pipeline in the plan)

A runner gets what it works with (the engine, the device, the accumulation, where packed
documents begin) and tells the loop around it what happens through `StepHooks`; it knows
nothing of the trainer.
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dr_scale.runtime import host_memory


@dataclass(frozen=True)
class StepHooks:
    """What a step tells the loop around it."""
    phase: Callable[[str], ContextManager]        # a named range (profilers, step_breakdown)
    loss_seen: Callable[[torch.Tensor], None]     # a micro-batch's loss (detached), for callbacks
    after_backward: Callable[[int], None]         # the micro-batch's index: the callbacks' point
    before_update: Callable[[], None]             # the weights are about to change
    report: Callable[[str, Any], None]            # a figure for the next training record

    @classmethod
    def quiet(cls) -> "StepHooks":
        """Hooks that do nothing (a runner driven on its own)."""
        return cls(lambda name: contextlib.nullcontext(), lambda loss: None,
                   lambda micro: None, lambda: None, lambda name, value: None)


class PlainSteps:
    phases = ("forward", "backward", "optimizer_step")

    def __init__(self, engine, device, accum: int, documents, hooks: StepHooks,
                 release_host_memory: bool = False):
        self.engine, self.device, self.accum, self.documents = engine, device, accum, documents
        self.hooks, self.release_host_memory = hooks, release_host_memory

    def train_step(self, batches) -> torch.Tensor:
        """The step's mean micro-batch loss (a device tensor: no host sync)."""
        hooks = self.hooks
        step_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.accum):
            batch = next(batches).to(self.device, non_blocking=True)
            with hooks.phase("forward"):
                loss = self.loss(batch)
            hooks.loss_seen(loss.detach())
            with hooks.phase("backward"):
                self.engine.backward(loss)
                if self.release_host_memory:  # before the step's fp32 gradients come
                    host_memory.release_freed()
            loss = report_loss_parts(self.engine, loss, hooks.report)
            hooks.after_backward(micro)
            if micro == self.accum - 1:
                hooks.before_update()  # checkpoint writes read the weights the step changes
            with hooks.phase("optimizer_step"):
                self.engine.step()
            step_loss += loss.detach().float()
        return step_loss / self.accum

    def loss(self, batch) -> torch.Tensor:
        """The mean loss of a (micro, seq + 1) token batch: inputs, shifted labels, and where
        packed documents begin when data.document_mask / data.reset_positions ask for it."""
        inputs = batch[:, :-1]
        return self.engine(inputs, batch[:, 1:], **self.documents.model_inputs(inputs))

    def eval_loss(self, batch) -> torch.Tensor:
        return self.loss(batch)

    def eval_done(self):
        pass


class PipelineSteps:
    phases = ("pipeline_step",)

    def __init__(self, engine, device, accum: int, documents, hooks: StepHooks):
        self.engine, self.device, self.accum, self.documents = engine, device, accum, documents
        self.hooks = hooks
        self._eval_shape = None  # the stages keep their buffers' shapes between batches

    def sample(self, batch):
        """(inputs, labels) as the first and last stages take them; with packed documents the
        inputs are (tokens, document ids, positions), carried through every stage."""
        return self.documents.pipeline_inputs(batch[:, :-1]), batch[:, 1:]

    def train_step(self, batches) -> torch.Tensor:
        micro = [next(batches).to(self.device, non_blocking=True) for _ in range(self.accum)]
        # the pipeline engine steps the optimizer inside train_batch: no overlap to be had
        self.hooks.before_update()
        with self.hooks.phase("pipeline_step"):
            loss = self.engine.train_batch(data_iter=iter([self.sample(b) for b in micro]))
        self.hooks.loss_seen(loss.detach())
        return loss.detach().float()  # DeepSpeed's mean over the micro-batches

    def eval_loss(self, batch) -> torch.Tensor:
        if batch.shape != self._eval_shape:
            self.engine.reset_activation_shape()
            self._eval_shape = batch.shape
        return self.engine.eval_batch(iter([self.sample(batch)]), num_micro_batches=1)

    def eval_done(self):
        if self._eval_shape is not None:  # training batches may differ from the last one
            self.engine.reset_activation_shape()
            self._eval_shape = None


def report_loss_parts(engine, loss, report):
    """The loss the loop shows: a model whose training loss adds terms of its own (the router's
    losses of a mixture of experts) keeps them in `loss_parts`; the LM loss is shown as the
    loss (what evaluation measures) and the rest go to the record as figures of their own."""
    parts = dict(getattr(engine.module, "loss_parts", None) or {})
    if not parts:
        return loss
    for name, value in parts.items():
        if name != "lm_loss":
            report(name, value)
    return parts["lm_loss"]


def for_topology(topology, engine, device, accum: int, documents, hooks: StepHooks,
                 release_host_memory: bool = False):
    """The runner of this run's engine kind."""
    if topology.pipelined:
        return PipelineSteps(engine, device, accum, documents, hooks)
    return PlainSteps(engine, device, accum, documents, hooks, release_host_memory)
