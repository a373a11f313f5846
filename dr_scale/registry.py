"""Registries: name -> builder, for models, datasets, schedules, callbacks (kernels, attention
included, have theirs in dr_scale.kernels.registry, with devices and precision policies)."""
from typing import Callable, Dict, Optional

from dr_scale.errors import DrScaleError


class Registry:
    """A named table of builders.

    >>> MODELS = Registry("model")
    >>> @MODELS.register()          # registered under the object's __name__
    ... class Foo: ...
    >>> @MODELS.register("bar")     # or under an explicit name
    ... def make_bar(): ...
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, Callable] = {}

    def register(self, name: Optional[str] = None, obj: Optional[Callable] = None):
        def add(o):
            key = name or o.__name__
            if key in self._items and self._items[key] is not o:
                raise DrScaleError(f"{self.kind} '{key}' is already registered")
            self._items[key] = o
            return o

        return add(obj) if obj is not None else add

    def get(self, name: str) -> Callable:
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise DrScaleError(f"unknown {self.kind} '{name}'; known: {known}")
        return self._items[name]

    def build(self, name: str, *args, **kwargs):
        return self.get(name)(*args, **kwargs)

    def names(self):
        return sorted(self._items)

    def __contains__(self, name):
        return name in self._items


MODEL_REGISTRY = Registry("model")
DATASET_REGISTRY = Registry("dataset")
SCHEDULE_REGISTRY = Registry("lr schedule")
CALLBACK_REGISTRY = Registry("callback")
