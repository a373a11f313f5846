"""Hugging Face weight folders read and written a tensor at a time: one `model.safetensors`, or
`model-0000k-of-0000n.safetensors` shards with `model.safetensors.index.json`.

Reading opens each file through safetensors' memory map and copies out one tensor (or a range of
its rows: a ZeRO-3 rank reads only its own partition), so no reader holds the whole model.
Writing fills shards up to a size limit and writes each when full, in the layout transformers
writes with `save_pretrained(max_shard_size=...)` (the same index and file names).
"""
import json
import math
import os
import re
from pathlib import Path
from typing import Dict, Iterable, Tuple

import torch

from dr_scale.errors import DrScaleError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*$", re.IGNORECASE)


def parse_size(text: str, source: str = "--max_shard_size") -> int:
    """'5GB', '500MB', '2GiB' -> bytes (decimal units as transformers reads them; KiB/MiB/GiB
    binary)."""
    m = _SIZE.match(str(text))
    if not m:
        raise DrScaleError(f"{source}: expected a size such as 5GB, 500MB or 2GiB, got {text!r}")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary else 1000) ** power)
    if size < 1:
        raise DrScaleError(f"{source}: must be at least one byte, got {text!r}")
    return size


class HFWeights:
    """The tensors of a folder, by name: shapes from the files' headers, values read on demand."""

    def __init__(self, folder):
        self.folder = Path(folder)
        files, self.file_of = self._locate()
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        from safetensors import safe_open

        for path in files:
            try:
                with safe_open(str(path), "pt") as f:
                    names = list(f.keys())
                    for name in names:
                        self.shapes[name] = tuple(f.get_slice(name).get_shape())
            except Exception as e:  # noqa: BLE001 - a corrupt header of any kind
                raise DrScaleError(f"{path}: unreadable safetensors file "
                                   f"({type(e).__name__})") from None
            for name in names:
                if self.file_of.setdefault(name, path) != path:
                    raise DrScaleError(f"{path}: holds {name}, which {INDEX} places in "
                                       f"{self.file_of[name].name}")
        missing = sorted(set(self.file_of) - set(self.shapes))
        if missing:
            raise DrScaleError(f"{self.folder / INDEX}: names {missing[0]} (and "
                               f"{len(missing) - 1} more) that no shard holds")

    def _locate(self):
        """(the weight files, name -> file as the index gives it, else empty)."""
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DrScaleError(f"{index}: unreadable index ({type(e).__name__}); expected "
                                   "a JSON object with a weight_map") from None
            files = {name: self.folder / file for name, file in weight_map.items()}
            absent = sorted({p.name for p in files.values() if not p.is_file()})
            if absent:
                raise DrScaleError(f"{index}: names shard {absent[0]}, which is not in "
                                   f"{self.folder}")
            return sorted(set(files.values())), files
        found = sorted(self.folder.glob("*.safetensors"))
        if not found:
            raise DrScaleError(f"{self.folder}: no .safetensors weights (only safetensors are "
                               "read, since pickled .bin files can execute code)")
        return found, {}  # names come from the headers

    def read(self, name: str, start: int = 0, end: int = None) -> torch.Tensor:
        """Tensor `name`, or elements [start, end) of it flattened (read by whole rows)."""
        from safetensors import safe_open

        shape = self.shapes[name]
        numel = math.prod(shape)
        end = numel if end is None else min(end, numel)
        path = self.file_of[name]
        try:
            with safe_open(str(path), "pt") as f:
                if start == 0 and end == numel:
                    return f.get_tensor(name)
                row = numel // shape[0] if shape else 1
                first, last = start // row, -(-end // row)
                rows = f.get_slice(name)[first:last].reshape(-1)
                return rows[start - first * row:end - first * row]
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt file of any kind
            raise DrScaleError(f"{path}: cannot read {name} ({type(e).__name__})") from None


class ShardWriter:
    """Tensors in, shards of at most `max_bytes` out (a tensor larger than that gets a shard of
    its own); `close()` names the files and writes the index when there is more than one."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = Path(out), max_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written = []  # (temporary file, names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self):
        from safetensors.torch import save_file

        path = self.out / f".shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> Iterable[Path]:
        if self.pending:
            self._flush()
        n = len(self.written)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]
        for (tmp, _), name in zip(self.written, names):
            os.replace(tmp, self.out / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: name for (_, ts), name in zip(self.written, names)
                                    for t in ts}}
            (self.out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [self.out / name for name in names]
