"""`callbacks.<name>: {enabled: true, key: value}` -> callback instances, options typed."""
from typing import List

# Importing the built-in callbacks registers them.
from dr_scale.callbacks import (dataloader_profiler, ema, grad_norm_monitor,  # noqa: F401
                                memory, nan_guard, per_layer_clip, step_profiler)
from dr_scale.callbacks.base import Callback
from dr_scale.errors import DrScaleError
from dr_scale.registry import CALLBACK_REGISTRY


def build_callbacks(callbacks_cfg, topology=None, optimizer: str = "adamw") -> List[Callback]:
    """Instantiate `callbacks.<name>` entries whose `enabled` is true; refuse, in one line, one
    that cannot run under a pipeline of `pipeline` stages, or beside `optimizer` (the
    DeepSpeedView's name of it)."""
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
        options = cls.options(**opts)  # checked even when not enabled
        if not enabled:
            continue
        if topology is not None and topology.pipelined and cls.not_with_pipeline:
            raise DrScaleError(f"callbacks.{name}: not available with parallel.pipeline_parallel="
                               f"{topology.pipeline} ({cls.not_with_pipeline})")
        if optimizer == "muon" and cls.not_with_muon:
            raise DrScaleError(f"callbacks.{name}: not available with optimizer Muon "
                               f"({cls.not_with_muon})")
        out.append(cls.from_options(options))
    return sorted(out, key=lambda cb: cb.order)
