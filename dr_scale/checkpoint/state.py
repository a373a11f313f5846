"""What a checkpoint holds beside DeepSpeed's files: one small dict per rank (layout.STATE_FILE),
loaded with weights_only=True (plain tensors and numbers, no code), made of its owners' entries.

Each owner gives its own entries and takes them back by itself, so no module reads another's
keys: the trainer (its step, data position, global batch), the random generators
(`RandomGenerators`, here), the layout that wrote it (layout.WrittenLayout), the callbacks
(callbacks/base.CallbackState, each callback's state under its name). An owner is anything with
`state_dict() -> dict` and `load_state_dict(saved)`, where `saved` is the whole dict and the owner
reads the entries it wrote. To save a new piece of state (a router's biases, say), give its owner
those two methods and add it to the trainer's `SavedState`.

The entries stay one level deep, as checkpoints written before owners existed have them, so
those load unchanged.
"""
import random
from typing import Dict, Protocol

import numpy as np
import torch


class StateOwner(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, saved: dict) -> None: ...


class SavedState:
    """The owners of a run's checkpointed state, by name."""

    def __init__(self, owners: Dict[str, StateOwner]):
        self.owners = dict(owners)

    def state_dict(self) -> dict:
        merged, given_by = {}, {}
        for name, owner in self.owners.items():
            for key, value in owner.state_dict().items():
                if key in given_by:  # a programming error, not a user's
                    raise RuntimeError(f"checkpoint entry {key!r} given by both "
                                       f"{given_by[key]} and {name}")
                merged[key], given_by[key] = value, name
        return merged

    def load_state_dict(self, saved: dict):
        for owner in self.owners.values():
            owner.load_state_dict(saved)


class RandomGenerators:
    """torch's (and this rank's CUDA device's), numpy's and Python's generators: entry "rng"."""

    def state_dict(self) -> dict:
        return {"rng": rng_state()}

    def load_state_dict(self, saved: dict):
        set_rng_state(saved["rng"])


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_pos": int(np_state[2]),
             "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (dropout on the GPU)
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32),
                         state["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"].tolist()), None))
