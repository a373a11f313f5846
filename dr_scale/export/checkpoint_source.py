"""A DeepSpeed checkpoint read a tensor at a time, in pieces, for exports that never hold the
whole model.

A source lists its tensors (name and whole shape, in the model's order) and yields each as fp32
1-D pieces of its flattened values, at most PIECE elements each:

- ZeRO-3: DeepSpeed's lazy consolidation (`zero_to_fp32`, lazy_mode) maps every rank's optimizer
  file and describes each parameter as a range of those flat fp32 groups; the pieces are read
  straight out of the maps. The maps are dropped and made again every RELOAD bytes read, so the
  pages already read leave the process (a mapped page counts in its resident size until then).
- ZeRO-1/2 and ZeRO-0: DeepSpeed consolidates the whole fp32 model in memory (its flat groups
  are not per parameter); read whole, then cut.
- Tensor parallel: one source per tensor rank, joined a tensor at a time: slices that stack by
  rows (column-parallel, vocabulary rows) are streamed rank after rank; slices joined along
  another dimension are put together for that one tensor.
- Pipeline: one file per layer (and tensor rank), loaded when its tensors are asked for.
- Expert parallel (ZeRO-1/2): each expert-data group's optimizer files hold its experts' fp32
  masters, which DeepSpeed's zero_to_fp32 does not read; its ds_to_universal joins them (one
  fp32 file per parameter, the experts stacked whole) into a temporary folder, read a tensor at
  a time.
"""
import gc
import math
import re
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from dr_scale.runtime import nvme_offload
from dr_scale.errors import DrScaleError

PIECE = 1 << 24           # elements per piece: 64 MiB in fp32
RELOAD = 512 * 2 ** 20    # bytes read through the maps before they are made again
# Resident set of `dr-scale export` before its first tensor (python, torch, DeepSpeed's checkpoint
# reader): its peak exporting the tiny preset (4M parameters) from ZeRO-3, 0.44 GiB on the 2-core
# CI machine (AMX Xeon, 2026-12-02).
EXPORT_RUNTIME_BYTES = 450 * 2**20


def export_peak_bytes(shape, zero_stage: int, topology) -> int:
    """Peak of `dr-scale export` of a run's checkpoint (this file and safetensors_folder.py; one
    process, not a rank): from ZeRO-3 the optimizer files' pages mapped until RELOAD bytes are
    read, and one piece in fp32 with its cast; from ZeRO-0/1/2 DeepSpeed's whole fp32 model (of
    one tensor rank, one pipeline layer file at a time); a tensor joined from its
    tensor-parallel slices whole."""
    from dr_scale.parallel.estimate import largest_tensor, meta_model

    n, largest = sum(p.numel() for p in meta_model(shape).parameters()), largest_tensor(shape)
    tp, pp = topology.tensor, topology.pipeline
    piece = min(PIECE, largest) * 4 * 2
    joined = largest * 4 if topology.sliced else 0
    held = min(RELOAD, 12 * n / tp) if zero_stage == 3 else 4 * n / tp / pp
    return int(EXPORT_RUNTIME_BYTES + held + piece + joined)


class Source:
    """Tensors by name: `entries` (name, whole shape) in order; `pieces(name)`."""
    entries: List[Tuple[str, Tuple[int, ...]]]

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        shape = dict(self.entries)[name]
        return torch.cat([p.float() for p in self.pieces(name)]).view(shape)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name, _ in self.entries}


def _cut(flat: torch.Tensor) -> Iterator[torch.Tensor]:
    for start in range(0, flat.numel(), PIECE):
        yield flat[start:start + PIECE]


class WholeSource(Source):
    """Tensors already in memory (ZeRO-0/1/2, EMA weights)."""

    def __init__(self, state: Dict[str, torch.Tensor], order: List[str] = None):
        self.state = state
        names = [n for n in (order or list(state)) if n in state]
        self.entries = [(n, tuple(state[n].shape)) for n in names]

    def pieces(self, name):
        yield from _cut(self.state[name].detach().reshape(-1).float())


class Zero3Source(Source):
    """One tensor rank's ZeRO-3 files in `ckpt_dir/tag`, read through DeepSpeed's lazy maps."""

    def __init__(self, ckpt_dir: Path, tag: str, describe: Callable[[Exception], DrScaleError]):
        self.ckpt_dir, self.tag, self.describe = ckpt_dir, tag, describe
        self.lazy, self.read_bytes = None, 0
        self.entries = [(n, tuple(t.shape)) for n, t in self._state().items()]

    def _state(self):
        if self.lazy is None or self.read_bytes >= RELOAD:
            self.lazy = None
            gc.collect()  # the maps go with the last tensor that views them
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            try:
                if (self.ckpt_dir / self.tag / nvme_offload.SAVED).is_dir():
                    self.lazy = _nvme_state(self.ckpt_dir / self.tag)
                else:
                    self.lazy = get_fp32_state_dict_from_zero_checkpoint(
                        str(self.ckpt_dir), tag=self.tag, lazy_mode=True)
            except Exception as e:  # noqa: BLE001 - any failure here is a damaged checkpoint
                raise self.describe(e) from None
            self.read_bytes = 0
        return self.lazy

    def pieces(self, name):
        value = self._state()[name]
        if isinstance(value, torch.Tensor):  # a buffer or frozen parameter, whole
            yield from _cut(value.reshape(-1).float())
            return
        # DeepSpeed's GatheredTensor: rank r holds [offset, offset + n) of its flat groups
        remaining = math.prod(value.shape)
        bounds = value.flat_groups_offset
        lo, hi = value.offset, value.offset + value.partitioned_numel
        for groups in value.flat_groups:
            for g, flat in enumerate(groups):
                a, b = max(lo, bounds[g]), min(hi, bounds[g + 1])
                for start in range(a - bounds[g], b - bounds[g], PIECE):
                    take = min(PIECE, b - bounds[g] - start, remaining)
                    if take <= 0:
                        return
                    piece = flat[start:start + take].float().clone()  # off the map
                    self.read_bytes += take * 4
                    remaining -= take
                    yield piece


class UniversalSource(Source):
    """The fp32 weights of a checkpoint converted to DeepSpeed's universal form (a folder of one
    `zero/<name>/fp32.pt` per parameter); `keep` holds what must live as long as the source
    (the temporary folder)."""

    def __init__(self, folder: Path, shapes: Dict[str, Tuple[int, ...]], keep=None,
                 buffers: Dict[str, torch.Tensor] = None):
        """`buffers`: saved buffers the conversion leaves out (ZeRO-3's expert-parallel form
        has no file for the routing bias), whole."""
        self.folder, self.keep, self.buffers = Path(folder), keep, buffers or {}
        self.entries = [(n, s) for n, s in shapes.items()
                        if (self.folder / "zero" / n / "fp32.pt").is_file() or n in self.buffers]

    def pieces(self, name):
        if not (self.folder / "zero" / name / "fp32.pt").is_file():
            yield from _cut(self.buffers[name].reshape(-1).float())
            return
        value = torch.load(self.folder / "zero" / name / "fp32.pt", map_location="cpu",
                           weights_only=False, mmap=True)  # DeepSpeed's pickle: {"param": ...}
        if isinstance(value, dict):
            value = value["param"]
        yield from _cut(value.reshape(-1).float())  # (ZeRO-3 expert-parallel: the tensor alone)


def _nvme_state(tag_dir: Path):
    """DeepSpeed's lazy ZeRO-3 consolidation for a checkpoint written with the optimizer state
    on NVMe (zero3_nvme): there the optimizer files hold empty fp32 groups for the sub-groups
    that were swapped out, and their fp32 master weights are the swap files DeepSpeed copied into
    offloaded_tensors/rankNN/<group id>.tensor.swp (raw fp32, padded to the I/O alignment).
    Those are mapped in place of the empty groups, their length from the parameter shapes the
    model file lists per group; then the consolidation is DeepSpeed's own steps
    (zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint, which reads no swap files)."""
    from deepspeed.utils import zero_to_fp32 as z

    model_states = z.parse_model_states(z.get_model_state_files(str(tag_dir)))
    stage, world, flat_groups, _ = z.parse_optim_states(z.get_optim_files(str(tag_dir)),
                                                        str(tag_dir))
    if stage != 3:
        raise ValueError(f"{nvme_offload.SAVED}/ beside a ZeRO-{stage} checkpoint")
    shapes = model_states[0].param_shapes
    for rank, groups in enumerate(flat_groups):
        for g, flat in enumerate(groups):
            if flat.numel() or not getattr(flat, "ds_id", None):
                continue
            numel = sum(math.ceil(math.prod(shape) / world) for shape in shapes[g].values())
            path = nvme_offload.saved_swap_dir(tag_dir, rank) / f"{flat.ds_id}.tensor.swp"
            groups[g] = torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32)
    return z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)


class PipelineSource(Source):
    """One tensor rank's layer files (`layer_NN-model_MM-model_states.pt`), named back to the
    model by its family's PipelineLayout (models/spec.py)."""

    def __init__(self, files: List[Path], num_layers: int, layout):
        self.file_of, self.entries = {}, []
        self.loaded_path, self.loaded = None, None
        for f in sorted(files, key=lambda f: int(re.match(r"layer_(\d+)", f.name).group(1))):
            layer = int(re.match(r"layer_(\d+)", f.name).group(1))
            for key, value in torch.load(f, map_location="cpu", weights_only=True,
                                         mmap=True).items():
                name = layout.model_name(layer, key, num_layers)
                self.file_of[name] = (f, key)
                self.entries.append((name, tuple(value.shape)))

    def pieces(self, name):
        path, key = self.file_of[name]
        if path != self.loaded_path:  # a layer's file at a time
            self.loaded = None
            self.loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self.loaded_path = path
        yield from _cut(self.loaded[key].reshape(-1).float())


class TensorJoin(Source):
    """Tensor ranks' sources joined into the model's shapes (`full`: name -> shape): equal
    shapes were replicated (rank 0's is taken); slices smaller in one dimension are joined
    along it."""

    def __init__(self, ranks: List[Source], full: Dict[str, Tuple[int, ...]], where: Path):
        self.ranks, self.where = ranks, where
        self.slices = [dict(r.entries) for r in ranks]
        self.entries = []
        for name, want in full.items():
            parts = [s.get(name) for s in self.slices]
            if name not in self.slices[0]:
                continue  # not in the checkpoint (a tied head): the caller decides
            if any(p is None for p in parts):
                raise DrScaleError(f"{where}: tensor rank files disagree on parameter {name}")
            if parts[0] != want:
                dims = [d for d in range(len(want)) if parts[0][d] != want[d]]
                joined = list(parts[0])
                if len(dims) == 1:
                    joined[dims[0]] = sum(p[dims[0]] for p in parts)
                if len(dims) != 1 or tuple(joined) != tuple(want):
                    raise DrScaleError(f"{where}: {name}: {len(parts)} slices of shape "
                                       f"{parts[0]} do not join into {tuple(want)}")
            self.entries.append((name, tuple(want)))

    def pieces(self, name):
        want = dict(self.entries)[name]
        first = self.slices[0][name]
        if first == want:
            yield from self.ranks[0].pieces(name)
        elif first[0] != want[0]:  # stacked by rows: rank after rank is the flattened order
            for rank in self.ranks:
                yield from rank.pieces(name)
        else:  # joined along a later dimension: this tensor put together whole
            dim = next(d for d in range(len(want)) if first[d] != want[d])
            yield from _cut(torch.cat([r.tensor(name) for r in self.ranks], dim=dim).reshape(-1))
