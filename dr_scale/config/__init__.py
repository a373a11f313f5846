"""Experiment config: YAML (+ `_base_`, `${env:VAR}`, dotted overrides) -> frozen RunConfig.

    cfg = load_config("configs/llama_125m.yaml", ["train.lr=3e-4"])
    cfg.freeze()        # before training; any later write raises
"""
from pathlib import Path
from typing import Optional, Sequence

from dr_scale.config.merge import apply_overrides, interpolate_env, load_chain
from dr_scale.config.schema import (DataConfig, DatasetSpec, LoggingConfig, ModelConfig,
                                    RunConfig, TrainConfig)
from dr_scale.config.typed import Section, from_dict

__all__ = ["load_config", "RunConfig", "ModelConfig", "DataConfig", "DatasetSpec", "TrainConfig",
           "LoggingConfig", "Section"]

EMBEDDED_DEFAULT = "<embedded default>"


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                env=None) -> RunConfig:
    """Load an experiment config; with no path, the embedded default (RunConfig's defaults)."""
    if path is not None:
        data, origins = load_chain(Path(path))
        source = str(Path(path).resolve())
    else:
        data, origins, source = {}, {}, EMBEDDED_DEFAULT
    data = apply_overrides(data, origins, overrides)
    # The defaults also hold ${env:...} (data.cache_dir), so interpolate after typing too.
    data = interpolate_env(data, origins, env=env)
    cfg = from_dict(RunConfig, data, origins, source)
    _interpolate_defaults(cfg, env)
    return cfg


def _interpolate_defaults(section: Section, env):
    import dataclasses

    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, Section):
            _interpolate_defaults(value, env)
        elif isinstance(value, str) and "${" in value:
            setattr(section, f.name, interpolate_env(value, {}, prefix=f.name, env=env))
