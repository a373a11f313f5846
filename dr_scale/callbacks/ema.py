"""ema: an exponential moving average of the weights, kept on this rank's slices of the fp32
master weights (no gather per step, under every ZeRO stage), evaluated at every evaluation
(`ema_eval_loss`), saved with each checkpoint and exportable (`dr-scale export --ema`)."""
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dr_scale.callbacks.base import Callback, CallbackState
from dr_scale.checkpoint.layout import STATE_FILE
from dr_scale.compat.shards import local_shards, write_values
from dr_scale.config.typed import Section, field
from dr_scale.errors import DrScaleError
from dr_scale.models.build import spec_of
from dr_scale.parallel.topology import Topology
from dr_scale.registry import CALLBACK_REGISTRY


@dataclass
class EMAOptions(Section):
    decay: float = field(0.999, min=0.0, help="in [0, 1): weight of the running average")
    start_step: int = field(0, min=0, help="until this step the average is the weights")


@CALLBACK_REGISTRY.register("ema")
class EMA(Callback):
    name = "ema"
    Options = EMAOptions
    not_with_pipeline = "it keeps the model's parameters by name, which pipeline stages rename"

    def __init__(self, decay: float = 0.999, start_step: int = 0):
        o = self.options(decay=decay, start_step=start_step)
        if o.decay >= 1.0:
            raise DrScaleError(f"callbacks.ema.decay: expected a number in [0, 1), got {decay!r}")
        self.decay, self.start_step = o.decay, o.start_step
        self.shards, self.ema, self._loaded = [], [], None

    def on_train_start(self, trainer):
        self.shards = local_shards(trainer.engine)
        if self._loaded is not None:
            state = self._loaded
            layout = [(s.name, s.whole_start, s.numel) for s in self.shards]
            saved = list(zip(state["names"], state["starts"].tolist(), state["numels"].tolist()))
            if layout != saved:
                raise DrScaleError("callbacks.ema: the checkpoint's EMA was kept for another "
                                   "layout of ranks or ZeRO stage; resume it with the same one")
            self.ema = [t.to(s.master.device) for t, s in zip(state["ema"], self.shards)]
        else:  # a new EMA, or one enabled after the checkpoint: it starts from the weights now
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
        write_values(trainer.engine, self.shards, self.ema, trainer.topology)
        try:
            record["ema_eval_loss"] = trainer.eval_loss()
        finally:
            write_values(trainer.engine, self.shards, current, trainer.topology)

    def state_dict(self):
        return {"names": [s.name for s in self.shards], "shapes": [list(s.shape) for s in self.shards],
                "starts": torch.tensor([s.whole_start for s in self.shards], dtype=torch.int64),
                "numels": torch.tensor([s.numel for s in self.shards], dtype=torch.int64),
                "ema": [e.detach() for e in self.ema],  # to the host by the checkpoint writer
                # split by expert parallelism, replicated over tensor ranks (load_ema_state)
                "experts": [s.expert for s in self.shards],
                "decay": self.decay}

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


def _experts_only(state: dict) -> dict:
    keep = [i for i, expert in enumerate(state.get("experts", [])) if expert]
    return {"names": [state["names"][i] for i in keep],
            "shapes": [state["shapes"][i] for i in keep],
            "starts": state["starts"][keep], "numels": state["numels"][keep],
            "ema": [state["ema"][i] for i in keep]}


def load_ema_state(tag_dir: Path, shape, tensor_rank: int = 0,
                   topology: Optional[Topology] = None) -> dict:
    """Whole EMA weights from the per-rank slices this callback saved with a checkpoint; under
    tensor parallelism, those of one tensor rank (its slices of the split parameters), and the
    experts' from every rank (they are not split over tensor ranks, and their ZeRO fragments lie
    on the ranks of every tensor rank)."""
    tag_dir = Path(tag_dir)
    states = []
    for path in sorted(tag_dir.glob(STATE_FILE.format(rank="*"))):
        rank = int(re.search(r"(\d+)\.pt$", path.name).group(1))
        other_tensor_rank = topology is not None and topology.coords(rank)["tensor"] != tensor_rank
        saved = torch.load(path, map_location="cpu", weights_only=True).get(CallbackState.KEY, {})
        if isinstance(saved, dict):  # keyed by callback name
            found = [saved[EMA.name]] if EMA.name in saved else []
        else:  # older checkpoints: a list by position; the EMA state is the one shaped like it
            found = [cb for cb in saved if isinstance(cb, dict) and "ema" in cb and "names" in cb]
        if other_tensor_rank:
            found = [_experts_only(state) for state in found]
        states += found
    if not states:
        raise DrScaleError(f"{tag_dir}: no EMA weights saved here (callbacks.ema.enabled was "
                           "off for this run)")
    return spec_of(shape.arch).tie_head(assemble(states), shape.tie_embeddings)

