"""Initial values that do not depend on the layout: element (i, j) of parameter `name` is the
same number whichever rank computes it, in whatever part of the tensor, on whatever device.

A tensor is seen as a matrix: its last dimension the columns, all the others the rows. The
matrix is cut into tiles of about BLOCK elements: the columns into COLUMN_CHUNKS equal chunks,
the rows into bands as tall as fit; tile (band, chunk) is drawn, in its own row-major order, by
a CPU generator of its own, seeded by the global seed (torch.manual_seed), the name, the band
and the chunk. A rank draws only the tiles its part touches:
- a ZeRO-3 partition (a range of the flat order) or a column-parallel slice (whole rows): the
  bands of its rows;
- a row-parallel slice (whole columns, the last dimension cut by tensor parallelism of 2, 4 or
  8): the chunks of its columns, 1/8 of the tensor's tiles for each chunk it holds.
So no rank draws the whole model, and no tensor is gathered to be set. (A band holds 65,536 /
(columns / 8) rows: a small tensor is one band, drawn whole by every rank that holds any row.)

Why tiles of torch's CPU generator rather than a counter-based hash of each element: a
vectorised hash with the Box-Muller transform ran at 20.7 ns an element on these CPUs against
torch.normal's 6.2 (measured 2026-12-04), and CPU generators give the same numbers on any
machine, so a GPU rank draws on its host and copies. A tile is drawn into a scratch buffer and
written to its place in the destination's dtype: a whole 8192 x 8192 tensor costs 4.45 ns an
element on one thread and 2.70 on two (the rank's threads draw its tiles at once), against 4.21
and 2.49 for blocks of the flat order drawn in place (medians of 6, interleaved), and a
row-parallel slice of TP 8 0.13x of its whole tensor (Intel Xeon with AMX, 2026-12-07; with
Python's default 5 ms GIL switch interval two threads gained nothing).
"""
import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from dr_scale.runtime.gil import short_switch_interval

BLOCK = 1 << 16  # elements a tile, about: 0.4 ms of drawing against microseconds of seeding
# Tensor parallelism cuts the columns of a row-parallel weight into 2, 4 or 8 equal parts (the
# size of a node): each is then whole chunks. Another degree draws the chunks it overlaps.
COLUMN_CHUNKS = 8


class Tiling:
    """Where the tiles of a tensor of `shape` lie (as a rows x columns matrix)."""

    def __init__(self, shape):
        shape = tuple(shape)
        self.columns = shape[-1] if shape else 1
        self.rows = math.prod(shape[:-1]) if shape else 1
        self.chunk = max(1, math.ceil(self.columns / COLUMN_CHUNKS))  # columns a tile
        self.band = max(1, BLOCK // self.chunk)  # rows a tile

    def tiles(self, rows: range, columns: range):
        """(band, chunk, its rows, its columns) of each tile overlapping rows x columns."""
        for band in range(rows.start // self.band, (rows.stop - 1) // self.band + 1):
            band_rows = range(band * self.band, min(self.rows, (band + 1) * self.band))
            for chunk in range(columns.start // self.chunk, (columns.stop - 1) // self.chunk + 1):
                yield band, chunk, band_rows, range(chunk * self.chunk,
                                                    min(self.columns, (chunk + 1) * self.chunk))


def _generator(seed: int, name: str, band: int, chunk: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}:{band}:{chunk}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def fill_block(rule: tuple, shape, name: str, rows: range, columns: range, out: torch.Tensor):
    """Write rows x columns of parameter `name`'s initial value (its `shape` seen as a matrix,
    Tiling) into `out`, (len(rows), len(columns)) of any floating dtype on the CPU: drawn in
    fp32, rounded once as it is written. `rule`: ("zeros",), ("ones",) or ("normal", std)
    (models/layers.py initial_rules)."""
    if rule[0] in ("zeros", "ones"):
        out.fill_(0.0 if rule[0] == "zeros" else 1.0)
        return
    if out.numel() == 0:
        return
    tiling, seed, std = Tiling(shape), torch.initial_seed(), rule[1]
    tiles = list(tiling.tiles(rows, columns))
    scratch = threading.local()

    def fill(some_tiles):
        for band, chunk, tile_rows, tile_columns in some_tiles:
            size = len(tile_rows) * len(tile_columns)
            if getattr(scratch, "buffer", None) is None or scratch.buffer.numel() < size:
                scratch.buffer = torch.empty(size, dtype=torch.float32)
            tile = scratch.buffer[:size].view(len(tile_rows), len(tile_columns))
            tile.normal_(0.0, std, generator=_generator(seed, name, band, chunk))
            r0, r1 = max(rows.start, tile_rows.start), min(rows.stop, tile_rows.stop)
            c0, c1 = max(columns.start, tile_columns.start), min(columns.stop, tile_columns.stop)
            out[r0 - rows.start:r1 - rows.start, c0 - columns.start:c1 - columns.start] = \
                tile[r0 - tile_rows.start:r1 - tile_rows.start,
                     c0 - tile_columns.start:c1 - tile_columns.start]

    workers = min(torch.get_num_threads(), len(tiles) // _TILES_A_THREAD)
    if workers <= 1:
        fill(tiles)
        return
    # Tiles are independent and land in disjoint parts of `out`: the rank's threads draw them at
    # once (runtime/gil.py: why the switch interval is shortened meanwhile), each a run of
    # neighbouring tiles (2.70 against 3.06 ns an element for every other tile, two threads)
    share = -(-len(tiles) // workers)
    with short_switch_interval(), \
            ThreadPoolExecutor(workers, thread_name_prefix="dr_scale draw") as pool:
        list(pool.map(fill, [tiles[i * share:(i + 1) * share] for i in range(workers)]))


_TILES_A_THREAD = 8  # fewer and a thread's start costs more than it draws


def fill_values(rule: tuple, shape, name: str, start: int, out: torch.Tensor):
    """Write elements [start, start + out.numel()) of the initial value in its flat (row-major)
    order into the 1-D `out` (a ZeRO-3 partition): its whole rows in place, the ragged ends of
    the first and last rows drawn whole and cut."""
    columns = Tiling(shape).columns
    end = start + out.numel()
    first_whole, end_whole = -(-start // columns), end // columns
    if first_whole >= end_whole:  # no row whole: the one or two rows it touches, cut
        first = start // columns
        touched = initial_block(rule, shape, name, range(first, -(-end // columns)),
                                range(columns))
        out.copy_(touched.view(-1)[start - first * columns:end - first * columns])
        return
    head, tail = first_whole * columns - start, end - end_whole * columns
    fill_block(rule, shape, name, range(first_whole, end_whole), range(columns),
               out[head:out.numel() - tail].view(-1, columns))
    if head:
        row = initial_block(rule, shape, name, range(first_whole - 1, first_whole), range(columns))
        out[:head].copy_(row.view(-1)[columns - head:])
    if tail:
        row = initial_block(rule, shape, name, range(end_whole, end_whole + 1), range(columns))
        out[out.numel() - tail:].copy_(row.view(-1)[:tail])


def initial_block(rule: tuple, shape, name: str, rows: range, columns: range) -> torch.Tensor:
    """Rows x columns of the initial value, fp32 on the CPU (fill_block)."""
    out = torch.empty(len(rows), len(columns), dtype=torch.float32)
    fill_block(rule, shape, name, rows, columns, out)
    return out


def fill_value(rule: tuple, name: str, out: torch.Tensor):
    """Write the parameter's whole initial value into `out` (its shape, any floating dtype,
    contiguous, on the CPU)."""
    tiling = Tiling(out.shape)
    fill_block(rule, out.shape, name, range(tiling.rows), range(tiling.columns),
               out.view(tiling.rows, tiling.columns))


def initial_value(rule: tuple, shape, name: str) -> torch.Tensor:
    """The parameter's initial value, whole, in fp32 on the CPU (device and dtype explicit: a
    default dtype or device set elsewhere does not reach it)."""
    out = torch.empty(tuple(shape), dtype=torch.float32)
    fill_value(rule, name, out)
    return out


def zero3_partition_range(param) -> tuple:
    """(start, count) of the flat elements a ZeRO-3 parameter's partition (`ds_tensor`) holds on
    this rank, as DeepSpeed cuts it: equal partitions of the size padded to the group, the last
    one's padding past the end."""
    import torch.distributed as dist

    size = param.ds_tensor.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, param.ds_numel - start))
