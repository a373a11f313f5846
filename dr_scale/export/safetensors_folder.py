"""Hugging Face weight folders read and written a tensor at a time: one `model.safetensors`, or
`model-0000k-of-0000n.safetensors` shards with `model.safetensors.index.json`.

Reading opens each file through safetensors' memory map and copies out one tensor (or a range of
its rows: a ZeRO-3 rank reads only its own partition), so no reader holds the whole model.
Writing streams tensors into shards up to a size limit, one piece of a tensor in memory at a
time, in the layout transformers writes with `save_pretrained(max_shard_size=...)` (the same
index and file names).
"""
import json
import math
import os
import re
from pathlib import Path
from typing import Dict, List, Tuple

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
        flat = end is not None or start > 0
        end = numel if end is None else min(end, numel)
        path = self.file_of[name]
        try:
            with safe_open(str(path), "pt") as f:
                if start == 0 and end == numel:  # (one rank's ZeRO-3 partition: all of it)
                    return f.get_tensor(name).reshape(-1) if flat else f.get_tensor(name)
                row = numel // shape[0] if shape else 1
                first, last = start // row, -(-end // row)
                rows = f.get_slice(name)[first:last].reshape(-1)
                return rows[start - first * row:end - first * row]
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt file of any kind
            raise DrScaleError(f"{path}: cannot read {name} ({type(e).__name__})") from None


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def plan_shards(entries, dtype, max_bytes: int) -> List[List[Tuple[str, tuple]]]:
    """(name, shape) entries in order, grouped into shards of at most `max_bytes` (a tensor
    larger than that gets a shard of its own), as transformers' save_pretrained groups them."""
    item = torch.empty((), dtype=dtype).element_size()
    shards, current, size = [], [], 0
    for name, shape in entries:
        nbytes = math.prod(shape) * item
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, tuple(shape)))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_shards(out: Path, entries, pieces, dtype, max_bytes: int,
                 progress=None) -> List[Path]:
    """Write `entries` ((name, shape) in order) from `pieces(name)` (1-D pieces of the
    flattened tensor, in order) as safetensors shards of at most `max_bytes`, one piece in memory
    at a time, plus the index when there is more than one shard. Each shard is written to a
    hidden name and renamed when complete.

    Why not safetensors' own writer: its save_file takes every tensor of a file at once, in
    memory; the format (an 8-byte header length, a JSON header of dtypes, shapes and byte
    offsets, then the raw little-endian data) lets a file be written tensor by tensor when the
    shapes are known first, which they are. Files are read back by safetensors itself."""
    import struct

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(entries, dtype, max_bytes)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    item = torch.empty((), dtype=dtype).element_size()
    weight_map, total = {}, 0
    for shard, file_name in zip(shards, names):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = math.prod(shape) * item
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        tmp = out / f".{file_name}.incoming"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name, shape in shard:
                written = 0
                for piece in pieces(name):
                    data = piece.to(dtype).contiguous()
                    f.write(data.view(torch.uint8).numpy().data)
                    written += data.numel()
                if written != math.prod(shape):
                    raise DrScaleError(f"{name}: {written} values read, its shape {shape} holds "
                                       f"{math.prod(shape)}")
                weight_map[name] = file_name
                if progress is not None:
                    progress(math.prod(shape) * item)
        os.replace(tmp, out / file_name)
        total += offset
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [out / name for name in names]
