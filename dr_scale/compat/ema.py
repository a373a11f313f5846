"""ema: an exponential moving average of the weights, kept on this rank's slices of the fp32
master weights (no gather per step, under every ZeRO stage), evaluated at every evaluation
(`ema_eval_loss`), saved with each checkpoint and exportable (`dr-scale export --ema`)."""
import torch

from dr_scale.compat.shards import local_shards, write_values
from dr_scale.errors import DrScaleError
from dr_scale.registry import CALLBACK_REGISTRY
from dr_scale.train.callbacks import Callback


@CALLBACK_REGISTRY.register("ema")
class EMA(Callback):
    def __init__(self, decay: float = 0.999, start_step: int = 0):
        if not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise TypeError(f"decay: expected a number in [0, 1), got {decay!r}")
        if not isinstance(start_step, int) or start_step < 0:
            raise TypeError(f"start_step: expected an integer >= 0, got {start_step!r}")
        self.decay, self.start_step = float(decay), start_step
        self.shards, self.ema, self._loaded = [], [], None

    def on_train_start(self, trainer):
        self.shards = local_shards(trainer.engine)
        if self._loaded is not None:
            state = self._loaded
            layout = [(s.name, s.start, s.numel) for s in self.shards]
            saved = list(zip(state["names"], state["starts"].tolist(), state["numels"].tolist()))
            if layout != saved:
                raise DrScaleError("callbacks.ema: the checkpoint's EMA was kept for another "
                                   "layout of ranks or ZeRO stage; resume it with the same one")
            self.ema = [t.to(s.master.device) for t, s in zip(state["ema"], self.shards)]
        else:
            self.ema = [s.master.detach().clone() for s in self.shards]

    def after_step(self, trainer, step, record):
        if not trainer.engine.was_step_applied():  # DeepSpeed skipped a non-finite step
            return
        masters = [s.master for s in self.shards]
        if not masters:
            return
        if step <= self.start_step:
            torch._foreach_copy_(self.ema, masters)
        else:
            torch._foreach_lerp_(self.ema, masters, 1.0 - self.decay)

    def on_evaluate(self, trainer, step, record):
        current = [s.master.detach().clone() for s in self.shards]
        write_values(trainer.engine, self.shards, self.ema)
        try:
            record["ema_eval_loss"] = trainer.eval_loss()
        finally:
            write_values(trainer.engine, self.shards, current)

    def state_dict(self):
        return {"names": [s.name for s in self.shards], "shapes": [list(s.shape) for s in self.shards],
                "starts": torch.tensor([s.start for s in self.shards], dtype=torch.int64),
                "numels": torch.tensor([s.numel for s in self.shards], dtype=torch.int64),
                "ema": [e.detach().cpu() for e in self.ema], "decay": self.decay}

    def load_state_dict(self, state):
        self._loaded = state


def assemble(rank_states) -> dict:
    """Whole EMA tensors from every rank's saved slices (used by export)."""
    full, shapes = {}, {}
    for state in rank_states:
        for name, shape, start, numel, t in zip(state["names"], state["shapes"],
                                                state["starts"].tolist(),
                                                state["numels"].tolist(), state["ema"]):
            if name not in full:
                shapes[name] = shape
                full[name] = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
            full[name].narrow(0, start, numel).copy_(t.view(-1))
    return {name: flat.view(*shapes[name]) for name, flat in full.items()}
