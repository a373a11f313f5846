"""Initial values that do not depend on the layout: element i of parameter `name` is the same
number whichever rank computes it, in whatever part of the tensor, on whatever device.

The tensor is cut, in its flat (row-major) order, into blocks of BLOCK elements; block b is drawn
by a CPU generator of its own, seeded by the global seed (torch.manual_seed), the name and b. A
rank that holds a ZeRO-3 partition (a range of the flat order) or a column slice draws only the
blocks its range touches: no rank draws the whole model, and no tensor is gathered to be set.
Why blocks of torch's CPU generator rather than a counter-based hash of each element: a
vectorised hash with the Box-Muller transform ran at 20.7 ns an element on these CPUs against
torch.normal's 6.2 (measured 2026-12-04), and CPU generators give the same numbers on any
machine, so a GPU rank draws on its host and copies. A rank's threads (torch.get_num_threads)
draw its blocks at once, whole blocks in place: 2.36 against 4.20 ns an element on two cores
(measured 2026-12-04; with Python's default 5 ms GIL switch interval two threads gained nothing).
"""
import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from dr_scale.runtime.gil import short_switch_interval

BLOCK = 1 << 16  # elements: 0.4 ms of drawing against a few microseconds of seeding


def _generator(seed: int, name: str, index: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def initial_values(rule: tuple, name: str, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of parameter `name`'s initial value in its flat order,
    fp32 on the CPU. `rule`: ("zeros",), ("ones",) or ("normal", std) (models/layers.py
    initial_rules)."""
    if rule[0] in ("zeros", "ones"):
        return torch.full((count,), 0.0 if rule[0] == "zeros" else 1.0, dtype=torch.float32)
    out = torch.empty(count, dtype=torch.float32)
    if count == 0:
        return out
    seed, std = torch.initial_seed(), rule[1]
    blocks = list(range(start // BLOCK, (start + count - 1) // BLOCK + 1))

    def fill(indices):
        for index in indices:
            lo, hi = max(start, index * BLOCK), min(start + count, (index + 1) * BLOCK)
            generator = _generator(seed, name, index)
            if hi - lo == BLOCK:  # a whole block: drawn in place, the same numbers
                out[lo - start:hi - start].normal_(0.0, std, generator=generator)
            else:
                block = torch.normal(0.0, std, size=(BLOCK,), generator=generator,
                                     dtype=torch.float32)
                out[lo - start:hi - start] = block[lo - index * BLOCK:hi - index * BLOCK]

    workers = min(torch.get_num_threads(), len(blocks) // _BLOCKS_A_THREAD)
    if workers <= 1:
        fill(blocks)
        return out
    # Blocks are independent: the rank's threads draw them at once (runtime/gil.py: why the
    # switch interval is shortened meanwhile)
    with short_switch_interval(), \
            ThreadPoolExecutor(workers, thread_name_prefix="dr_scale draw") as pool:
        list(pool.map(fill, [blocks[i::workers] for i in range(workers)]))
    return out


_BLOCKS_A_THREAD = 8  # fewer and a thread's start costs more than it draws


def initial_value(rule: tuple, shape, name: str) -> torch.Tensor:
    """The parameter's initial value, whole, in fp32 on the CPU (device and dtype explicit: a
    default dtype or device set elsewhere does not reach it)."""
    shape = tuple(shape)
    return initial_values(rule, name, 0, int(torch.Size(shape).numel())).view(shape)


def zero3_partition_range(param) -> tuple:
    """(start, count) of the flat elements a ZeRO-3 parameter's partition (`ds_tensor`) holds on
    this rank, as DeepSpeed cuts it: equal partitions of the size padded to the group, the last
    one's padding past the end."""
    import torch.distributed as dist

    size = param.ds_tensor.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, param.ds_numel - start))
