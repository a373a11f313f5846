"""Typed config sections: dict -> dataclass with validation, and freezing.

Each field may carry metadata: ``min``/``max`` (inclusive bounds), ``choices`` and ``help``.
Errors name the file the key came from, the dotted key and what was expected.
"""
import dataclasses
import difflib
import typing
from typing import Any, Dict, Mapping

from dr_scale.errors import DrScaleError


class Section:
    """Base of every config dataclass: attribute writes raise once frozen."""

    _frozen: bool = False

    def __setattr__(self, name, value):
        if self._frozen:
            raise DrScaleError(
                f"config is frozen: cannot set '{name}' (configs are frozen before training starts)")
        object.__setattr__(self, name, value)

    def freeze(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for item in (value if isinstance(value, list) else [value]):
                if isinstance(item, Section):
                    item.freeze()
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
            if isinstance(value, dict):
                object.__setattr__(self, f.name, _FrozenDict(value))
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value = value.to_dict()
            elif isinstance(value, (list, tuple)):
                value = [v.to_dict() if isinstance(v, Section) else v for v in value]
            elif isinstance(value, Mapping):
                value = _plain(value)
            out[f.name] = value
        return out


class _FrozenDict(dict):
    def _refuse(self, *a, **k):
        raise DrScaleError("config is frozen: cannot change a mapping inside it")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse


def _plain(value):
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin in (list, tuple):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, Section):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _where(source, key: str) -> str:
    """`file: key`, or the key alone where no file is known (options given in code)."""
    return f"{source}: {key}" if source else key


def convert(tp, value, key: str, source: str):
    """Convert a YAML value to the annotated type, or raise a one-line DrScaleError."""
    def fail(expected=None):
        raise DrScaleError(
            f"{_where(source, key)}: expected {expected or _type_name(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return convert(args[0], value, key, source)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail()
        (item_tp,) = typing.get_args(tp)
        return [convert(item_tp, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            fail()
        return dict(value)
    if tp is typing.Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Section):
        if not isinstance(value, Mapping):
            fail()
        return from_dict(tp, value, {}, source, prefix=key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail()
    if tp is int:
        if isinstance(value, bool):
            fail()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        fail()
    if tp is float:
        if isinstance(value, bool):
            fail()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        fail()
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        fail()
    return value


def from_dict(cls, data: Mapping, origins: Mapping[str, str], default_source: str, prefix=""):
    """Build dataclass ``cls`` from ``data``; ``origins`` maps dotted keys to their file."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = prefix + str(name)
        source = origins.get(key, default_source)
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            known = ", ".join(fields)
            raise DrScaleError(f"{_where(source, key)}: unknown key{hint}; known keys here: "
                               f"{known}")
        f = fields[name]
        tp = hints[name]
        if isinstance(tp, type) and issubclass(tp, Section) and isinstance(value, Mapping):
            kwargs[name] = from_dict(tp, value, origins, default_source, prefix=key + ".")
            continue
        converted = convert(tp, value, key, source)
        _check_range(f, converted, key, source)
        kwargs[name] = converted
    return cls(**kwargs)


def _check_range(f, value, key, source):
    if value is None:
        return
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        choices = ", ".join(str(c).lower() if isinstance(c, bool) else str(c)  # as YAML writes
                            for c in meta["choices"])
        raise DrScaleError(f"{_where(source, key)}: expected one of {choices}, got {value!r}")
    if "min" in meta and value < meta["min"]:
        raise DrScaleError(f"{_where(source, key)}: expected a value >= {meta['min']}, got "
                           f"{value!r}")
    if "max" in meta and value > meta["max"]:
        raise DrScaleError(f"{_where(source, key)}: expected a value <= {meta['max']}, got "
                           f"{value!r}")


def field(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, **meta):
    """dataclasses.field with validation metadata (min, max, choices, help)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
