"""Rotary frequency scaling of the Llama-3 kind (Llama-3.1 and 3.2 checkpoints): long wavelengths
are divided by `factor`, short ones kept, and those between blended smoothly, so a model trained
at `original_max_position_embeddings` reads longer contexts. The same rule as Meta's release and
transformers' `rope_type: llama3` (checked against transformers' rotary tables in
tests/test_export.py).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from dr_scale.errors import DrScaleError

_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def parse(cls, value, source: str) -> Optional["RopeScaling"]:
        """From a config mapping (ours or a Hugging Face config's `rope_scaling`); None or a
        `default` type is no scaling. One-line errors name `source`."""
        if value is None or isinstance(value, RopeScaling):
            return value
        if not isinstance(value, dict):
            raise DrScaleError(f"{source}: expected a mapping with rope_type and "
                               f"{', '.join(_FIELDS)}, got {value!r}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind in ("default", None):
            return None
        if kind != "llama3":
            raise DrScaleError(f"{source}: rope_type {kind!r} is not supported (default or "
                               f"llama3)")
        missing = [k for k in _FIELDS if k not in value]
        if missing:
            raise DrScaleError(f"{source}: llama3 rope scaling needs {', '.join(missing)}")
        try:
            out = cls("llama3", float(value["factor"]), float(value["low_freq_factor"]),
                      float(value["high_freq_factor"]),
                      int(value["original_max_position_embeddings"]))
        except (TypeError, ValueError):
            raise DrScaleError(f"{source}: llama3 rope scaling values must be numbers, got "
                               f"{value!r}") from None
        if out.factor < 1 or out.high_freq_factor <= out.low_freq_factor or \
                out.original_max_position_embeddings < 1:
            raise DrScaleError(f"{source}: expected factor >= 1, high_freq_factor > "
                               f"low_freq_factor and original_max_position_embeddings >= 1, got "
                               f"{value!r}")
        return out

    def to_hf(self) -> dict:
        return {"rope_type": self.rope_type, **{k: getattr(self, k) for k in _FIELDS}}

    def __call__(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies."""
        wavelength = 2 * math.pi / inv_freq
        ratio = self.original_max_position_embeddings / wavelength  # periods in the old context
        # 0 where the wavelength is long (scaled fully), 1 where short (kept), linear between
        keep = ((ratio - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor))
        keep = keep.clamp(0.0, 1.0)
        return (1 - keep) * inv_freq / self.factor + keep * inv_freq
