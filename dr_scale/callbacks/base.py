"""Callbacks: behaviour that plugs into the training loop at named points.

    class PrintLR(Callback):
        name = "print_lr"
        def after_step(self, trainer, step, record): print(trainer.current_lr())
    trainer.register_callback(PrintLR())

A callback knows the trainer only through `TrainerView` (below), so this module imports nothing
of the trainer. Built-in callbacks declare their YAML options as a typed `Options` section
(`callbacks.<name>.<key>`, checked with the experiment config's rules) and what they cannot run
under (`not_with_pipeline`). Their checkpointed state is keyed by `name`.
"""
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

from dr_scale.config.typed import Section, from_dict
from dr_scale.errors import DrScaleError

POINTS = ("on_train_start", "before_step", "after_backward", "after_step", "on_evaluate",
          "on_checkpoint", "on_resume", "on_exit")


class TrainerView(Protocol):
    """What a callback may use of the trainer."""

    engine: Any            # the DeepSpeed engine
    cfg: Any               # the frozen RunConfig
    topology: Any          # dr_scale.parallel.topology.Topology
    batch_sizes: Dict[str, int]  # micro, accum, global
    device: Any
    run_dir: Path
    logger: Any            # dr_scale.train.metrics.MetricsLogger
    step: int
    last_loss: Any         # the latest micro-batch loss (a tensor)
    last_checkpoint: Optional[Path]

    def report(self, name: str, value) -> None: ...
    def will_log(self, step: int) -> bool: ...
    def eval_loss(self) -> float: ...
    def current_lr(self) -> float: ...


@dataclasses.dataclass
class NoOptions(Section):
    pass


class Callback:
    """Every point is a no-op here; override the ones you need. Callbacks switched on from the
    YAML fire in ascending `order`, then in the order written."""

    name: str = ""                    # key of its options and of its checkpointed state
    order: int = 0
    Options = NoOptions               # typed `callbacks.<name>.*` keys
    # Why it cannot run under DeepSpeed's pipeline engine (None: it can).
    not_with_pipeline: Optional[str] = None
    not_with_muon: Optional[str] = None  # why it cannot run beside optimizer Muon, if it cannot

    @classmethod
    def options(cls, **values) -> Section:
        """`values` checked against `Options`: a wrong key or value is one line naming
        `callbacks.<name>.<key>`."""
        return from_dict(cls.Options, values, {}, None, prefix=f"callbacks.{cls.state_key()}.")

    @classmethod
    def from_options(cls, options: Section) -> "Callback":
        return cls(**options.to_dict())

    @classmethod
    def state_key(cls) -> str:
        return cls.name or cls.__name__

    def on_train_start(self, trainer: TrainerView): ...
    def before_step(self, trainer: TrainerView, step): ...
    def after_backward(self, trainer: TrainerView, step, micro_step): ...
    def after_step(self, trainer: TrainerView, step, record): ...  # record: None unless logged
    def on_evaluate(self, trainer: TrainerView, step, record): ...
    def on_checkpoint(self, trainer: TrainerView, step, path): ...
    def on_resume(self, trainer: TrainerView, step, path): ...
    def on_exit(self, trainer: TrainerView): ...

    def wrap_loader(self, trainer: TrainerView, loader):
        """Return the iterable of training batches to use instead of `loader` (profilers)."""
        return loader

    # State saved with each checkpoint, per rank (tensors, numbers, strings, lists, dicts).
    def state_dict(self): return {}
    def load_state_dict(self, state): ...
    def on_missing_state(self, trainer: TrainerView):
        """Resumed from a checkpoint that holds no state of this callback (it was enabled
        after that checkpoint was written): start fresh."""


class CallbackList:
    def __init__(self, callbacks: List[Callback] = ()):
        self.callbacks = []
        for cb in callbacks:
            self.add(cb)

    def add(self, cb: Callback):
        if not isinstance(cb, Callback):
            raise DrScaleError(f"register_callback: expected a Callback, got {type(cb).__name__}")
        if cb.state_key() in self.names():
            raise DrScaleError(f"register_callback: a callback named '{cb.state_key()}' is "
                               "already registered (names key the checkpointed state)")
        self.callbacks.append(cb)

    def names(self) -> List[str]:
        return [cb.state_key() for cb in self.callbacks]

    def fire(self, point: str, *args):
        for cb in self.callbacks:
            getattr(cb, point)(*args)

    def state_dict(self) -> Dict[str, Any]:
        return {cb.state_key(): cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, saved, trainer: TrainerView, log) -> None:
        """Each callback gets its own saved state by name; one enabled since starts fresh, and
        state of one no longer enabled is named in one line and left alone."""
        if isinstance(saved, list):  # older checkpoints: a list by position, names unknown
            if saved:
                log("callbacks: this checkpoint keeps callback state by position (an older "
                    "format); not restored: each callback starts fresh")
            saved = {}
        for cb in self.callbacks:
            if cb.state_key() in saved:
                cb.load_state_dict(saved[cb.state_key()])
            else:
                log(f"callbacks.{cb.state_key()}: no state in the checkpoint (enabled after it "
                    "was written): starts fresh")
                cb.on_missing_state(trainer)
        for name in saved:
            if name not in self.names():
                log(f"callbacks.{name}: state in the checkpoint, but the callback is not "
                    "enabled now: its state is not used")


class CallbackState:
    """The callbacks as one owner of a checkpoint's state (checkpoint/state.py): the entry
    "callbacks", each callback's state under its name."""

    KEY = "callbacks"

    def __init__(self, callbacks: CallbackList, trainer: TrainerView, log):
        self.callbacks, self.trainer, self.log = callbacks, trainer, log

    def state_dict(self) -> dict:
        return {self.KEY: self.callbacks.state_dict()}

    def load_state_dict(self, saved: dict):
        self.callbacks.load_state_dict(saved.get(self.KEY, {}), self.trainer, self.log)

