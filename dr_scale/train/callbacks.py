"""Callbacks: behaviour that plugs into the loop at named points.

    class PrintLR(Callback):
        def after_step(self, trainer, step, record): print(trainer.current_lr())
    trainer.register_callback(PrintLR())

YAML switches registered callbacks on as `callbacks.<name>.enabled: true`; the other keys under
the name are passed to the callback's constructor.
"""
from typing import List

from dr_scale.errors import DrScaleError
from dr_scale.registry import CALLBACK_REGISTRY

POINTS = ("on_train_start", "before_step", "after_backward", "after_step", "on_evaluate",
          "on_checkpoint", "on_resume", "on_exit")


class Callback:
    """Every point is a no-op here; override the ones you need. Callbacks switched on from the
    YAML fire in ascending `order`, then in the order written."""

    order = 0

    def on_train_start(self, trainer): ...
    def before_step(self, trainer, step): ...
    def after_backward(self, trainer, step, micro_step): ...
    def after_step(self, trainer, step, record): ...  # record: None except on log steps
    def on_evaluate(self, trainer, step, record): ...
    def on_checkpoint(self, trainer, step, path): ...
    def on_resume(self, trainer, step, path): ...
    def on_exit(self, trainer): ...

    def wrap_loader(self, trainer, loader):
        """Return the iterable of training batches to use instead of `loader` (profilers)."""
        return loader

    # State saved with each checkpoint, per rank (tensors, numbers, strings, lists, dicts).
    def state_dict(self): return {}
    def load_state_dict(self, state): ...


class CallbackList:
    def __init__(self, callbacks: List[Callback] = ()):
        self.callbacks = list(callbacks)

    def add(self, cb: Callback):
        if not isinstance(cb, Callback):
            raise DrScaleError(f"register_callback: expected a Callback, got {type(cb).__name__}")
        self.callbacks.append(cb)

    def fire(self, point: str, *args):
        for cb in self.callbacks:
            getattr(cb, point)(*args)


def build_callbacks(callbacks_cfg) -> List[Callback]:
    """Instantiate `callbacks.<name>` entries whose `enabled` is true."""
    # Importing registers the built-in callbacks.
    from dr_scale.compat import (clipping, dataloader_profiler, ema, grad_monitor,  # noqa: F401
                                 memory, step_profiler)
    from dr_scale.train import nan_guard  # noqa: F401

    out = []
    for name, opts in (callbacks_cfg or {}).items():
        if opts is None:
            opts = {}
        if not isinstance(opts, dict):
            raise DrScaleError(f"callbacks.{name}: expected a mapping with 'enabled', got {opts!r}")
        opts = dict(opts)
        enabled = opts.pop("enabled", False)
        if not isinstance(enabled, bool):
            raise DrScaleError(f"callbacks.{name}.enabled: expected true or false, got {enabled!r}")
        try:
            cls = CALLBACK_REGISTRY.get(name)
        except DrScaleError as e:
            raise DrScaleError(f"callbacks.{name}: {e}") from None
        if enabled:
            try:
                out.append(cls(**opts))
            except (TypeError, DrScaleError) as e:
                raise DrScaleError(f"callbacks.{name}: {e}") from None
    return sorted(out, key=lambda cb: cb.order)
