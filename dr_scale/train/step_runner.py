"""One optimizer step, and one held-out loss, by engine kind: chosen once from the Topology
(`for_topology`), so the trainer's loop keeps only the cadence (log, evaluate, save, signals).

    PlainSteps     DeepSpeed's engine: forward, backward and the callbacks' after_backward for
                   each micro-batch of the accumulation, the optimizer step at its end
    PipelineSteps  DeepSpeed's pipeline engine: `train_batch` runs the step's micro-batches
                   through the stages and steps the optimizer inside (the callbacks that must
                   run between backward and step are refused under a pipeline in the plan)
"""
import torch

from dr_scale.runtime import hangs, host_memory


class PlainSteps:
    phases = ("forward", "backward", "optimizer_step")

    def __init__(self, trainer):
        self.trainer = trainer

    def train_step(self, batches) -> torch.Tensor:
        """The step's mean micro-batch loss (a device tensor: no host sync)."""
        tr, accum = self.trainer, self.trainer.batch_sizes["accum"]
        step_loss = torch.zeros((), dtype=torch.float32, device=tr.device)
        for micro in range(accum):
            batch = next(batches).to(tr.device, non_blocking=True)
            with tr.phase("forward"):
                loss = self.loss(batch)
            tr.last_loss = loss.detach()
            with tr.phase("backward"):
                tr.engine.backward(loss)
                if tr.cfg.train.release_host_memory:  # before the step's fp32 gradients come
                    host_memory.release_freed()
            loss = report_loss_parts(tr, loss)
            tr.callbacks.fire("after_backward", tr, tr.step, micro)
            if micro == accum - 1:
                with hangs.doing(f"step {tr.step + 1}: waiting for checkpoint writes"):
                    tr.writer.before_update()  # they read the weights the step now changes
            with tr.phase("optimizer_step"):
                tr.engine.step()
            step_loss += loss.detach().float()
        return step_loss / accum

    def loss(self, batch) -> torch.Tensor:
        """The mean loss of a (micro, seq + 1) token batch: inputs, shifted labels, and where
        packed documents begin when data.document_mask / data.reset_positions ask for it."""
        inputs = batch[:, :-1]
        return self.trainer.engine(inputs, batch[:, 1:],
                                   **self.trainer.documents.model_inputs(inputs))

    def eval_loss(self, batch) -> torch.Tensor:
        return self.loss(batch)

    def eval_done(self):
        pass


class PipelineSteps:
    phases = ("pipeline_step",)

    def __init__(self, trainer):
        self.trainer = trainer
        self._eval_shape = None  # the stages keep their buffers' shapes between batches

    def sample(self, batch):
        """(inputs, labels) as the first and last stages take them; with packed documents the
        inputs are (tokens, document ids, positions), carried through every stage."""
        return self.trainer.documents.pipeline_inputs(batch[:, :-1]), batch[:, 1:]

    def train_step(self, batches) -> torch.Tensor:
        tr = self.trainer
        micro = [next(batches).to(tr.device, non_blocking=True)
                 for _ in range(tr.batch_sizes["accum"])]
        # the pipeline engine steps the optimizer inside train_batch: no overlap to be had
        with hangs.doing(f"step {tr.step + 1}: waiting for checkpoint writes"):
            tr.writer.before_update()
        with tr.phase("pipeline_step"):
            loss = tr.engine.train_batch(data_iter=iter([self.sample(b) for b in micro]))
        tr.last_loss = loss.detach()
        return loss.detach().float()  # DeepSpeed's mean over the micro-batches

    def eval_loss(self, batch) -> torch.Tensor:
        engine = self.trainer.engine
        if batch.shape != self._eval_shape:
            engine.reset_activation_shape()
            self._eval_shape = batch.shape
        return engine.eval_batch(iter([self.sample(batch)]), num_micro_batches=1)

    def eval_done(self):
        if self._eval_shape is not None:  # training batches may differ from the last one
            self.trainer.engine.reset_activation_shape()
            self._eval_shape = None


def report_loss_parts(trainer, loss):
    """The loss the loop shows: a model whose training loss adds terms of its own (the router's
    losses of a mixture of experts) keeps them in `loss_parts`; the LM loss is shown as the
    loss (what evaluation measures) and the rest go to the record as figures of their own."""
    parts = dict(getattr(trainer.engine.module, "loss_parts", None) or {})
    if not parts:
        return loss
    for name, value in parts.items():
        if name != "lm_loss":
            trainer.report(name, value)
    return parts["lm_loss"]


def for_topology(topology, trainer):
    """The runner of this run's engine kind."""
    return PipelineSteps(trainer) if topology.pipelined else PlainSteps(trainer)
