"""The held-out loss: the mean token loss over every data-parallel rank's share of the held-out
samples, with the current weights, through the step runner of the engine's kind."""
import torch

from dr_scale.data.loader import eval_batches
from dr_scale.runtime import comm


class Evaluator:
    """`steps`: train/step_runner.py's runner (its `eval_loss` and `eval_done`)."""

    def __init__(self, engine, valid, micro: int, topology, device, steps):
        self.engine, self.valid, self.micro, self.device = engine, valid, micro, device
        self.dp_size, self.dp_rank, self.steps = topology.data, topology.data_rank, steps

    @torch.no_grad()
    def loss(self) -> tuple:
        """(mean loss, tokens) over all data-parallel ranks."""
        self.engine.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        for batch in eval_batches(self.valid, self.micro, self.dp_size, self.dp_rank):
            batch = batch.to(self.device)
            loss = self.steps.eval_loss(batch)
            tokens = batch[:, 1:].numel()
            totals += torch.tensor([loss.float().item() * tokens, tokens], dtype=torch.float64)
        comm.all_reduce(totals)
        self.steps.eval_done()
        self.engine.train()
        forget_zero3_trace(self.engine)
        return (totals[0] / totals[1]).item(), int(totals[1])


def forget_zero3_trace(engine):
    """ZeRO-3 prefetches parameters by replaying the module order it recorded; forward-only
    evaluation passes leave it a trace that training steps never match again, and training ran
    ~20% slower after the step-0 evaluation (llama_125m, 2 CPU ranks). Dropping the trace after
    each evaluation makes the next training step record a fresh one. (DeepSpeed has no public
    call for this; the coordinator's own invalidation is used.)"""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        return
    coordinator = offload.get_param_coordinator()
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
