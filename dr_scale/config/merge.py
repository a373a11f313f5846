"""YAML loading: `_base_:` inheritance, `${env:VAR[,default]}` and dotted command-line overrides.

Every function returns (data, origins): origins maps each dotted key to the file (or
"command line") that set it last, so validation errors can name where a value came from.
"""
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from dr_scale.errors import DrScaleError

BASE_KEY = "_base_"
_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")

Origins = Dict[str, str]


def read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DrScaleError(f"{path}: config file not found") from None
    except OSError as e:
        raise DrScaleError(f"{path}: cannot read config file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise DrScaleError(f"{path}: YAML syntax error{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DrScaleError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict, top: Mapping, base_origins: Origins, source: str, prefix="") -> dict:
    """Merge ``top`` into a copy of ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in top.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value, base_origins, source, dotted + ".")
        else:
            for k in [k for k in base_origins if k == dotted or k.startswith(dotted + ".")]:
                del base_origins[k]
            out[key] = value
            _record(value, dotted, source, base_origins)
    return out


def _record(value, dotted: str, source: str, origins: Origins):
    origins[dotted] = source
    if isinstance(value, Mapping):
        for k, v in value.items():
            _record(v, f"{dotted}.{k}", source, origins)


def load_chain(path, _stack: Optional[List[Path]] = None) -> Tuple[dict, Origins]:
    """Load ``path`` after the files named by its ``_base_`` (a path or a list, relative to it)."""
    path = Path(path).expanduser().resolve()
    stack = list(_stack or [])
    if path in stack:
        cycle = " -> ".join(str(p) for p in stack + [path])
        raise DrScaleError(f"{path}: {BASE_KEY}: inheritance cycle: {cycle}")
    data = read_yaml(path)
    bases = data.pop(BASE_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise DrScaleError(f"{path}: {BASE_KEY}: expected a path or a list of paths, got {bases!r}")
    merged: dict = {}
    origins: Origins = {}
    for base in bases:
        base_path = (path.parent / os.path.expanduser(base))
        if not base_path.exists():
            raise DrScaleError(f"{path}: {BASE_KEY}: base file not found: {base_path}")
        base_data, base_origins = load_chain(base_path, stack + [path])
        for k in base_origins:
            origins.pop(k, None)
        merged = deep_merge(merged, base_data, origins, "")
        origins.update(base_origins)
    merged = deep_merge(merged, data, origins, str(path))
    return merged, origins


def interpolate_env(data, origins: Origins, prefix="", env: Optional[Mapping] = None):
    """Replace ``${env:VAR}`` / ``${env:VAR,default}`` in every string value."""
    env = os.environ if env is None else env
    if isinstance(data, Mapping):
        return {k: interpolate_env(v, origins, f"{prefix}{k}.", env) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate_env(v, origins, prefix, env) for v in data]
    if not isinstance(data, str) or "${" not in data:
        return data
    key = prefix.rstrip(".")

    def sub(m):
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise DrScaleError(
            f"{origins.get(key, '<config>')}: {key}: environment variable {name} is not set "
            f"(give a default as ${{env:{name},DEFAULT}})")

    out = _ENV.sub(sub, data)
    if "${" in out:
        raise DrScaleError(f"{origins.get(key, '<config>')}: {key}: cannot interpolate {data!r}; "
                           "expected ${env:VAR} or ${env:VAR,default}")
    # A value that was only an interpolation takes the YAML type of what it became: "3e-4" stays
    # a string for the typed layer to convert, "true" becomes a bool, "12" an int.
    if _ENV.fullmatch(data):
        try:
            parsed = yaml.safe_load(out)
        except yaml.YAMLError:
            return out
        return parsed if isinstance(parsed, (bool, int, float)) or parsed is None else out
    return out


def apply_overrides(data: dict, origins: Origins, overrides: Sequence[str]) -> dict:
    """Apply ``dotted.key=value`` strings; values are read as YAML (``[1,2]``, ``true``, ``1e-3``)."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise DrScaleError(f"command line: {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise DrScaleError(f"command line: {item!r}: expected dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        nested = value
        for part in reversed(parts):
            nested = {part: nested}
        data = deep_merge(data, nested, origins, "command line")
    return data
