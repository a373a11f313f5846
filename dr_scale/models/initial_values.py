"""Initial values that do not depend on the layout: element i of parameter `name` is the same
number whichever rank computes it, in whatever part of the tensor, on whatever device.

The tensor is cut, in its flat (row-major) order, into blocks of BLOCK elements; block b is drawn
by a CPU generator of its own, seeded by the global seed (torch.manual_seed), the name and b. A
rank that holds a ZeRO-3 partition (a range of the flat order) or a column slice draws only the
blocks its range touches: no rank draws the whole model, and no tensor is gathered to be set.
Why blocks of torch's CPU generator rather than a counter-based hash of each element: a
vectorised hash with the Box-Muller transform ran at 20.7 ns an element on these CPUs against
torch.normal's 6.2 (measured 2026-12-04), and CPU generators give the same numbers on any
machine, so a GPU rank draws on its host and copies. (Drawing blocks on two threads at once
gained nothing here: 5.75 against 5.87 ns an element.)
"""
import hashlib
import torch

BLOCK = 1 << 16  # elements: 0.4 ms of drawing against a few microseconds of seeding


def _block(seed: int, name: str, index: int, std: float) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}:{name}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.normal(0.0, std, size=(BLOCK,), generator=generator, dtype=torch.float32)


def initial_values(rule: tuple, name: str, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of parameter `name`'s initial value in its flat order,
    fp32 on the CPU. `rule`: ("zeros",), ("ones",) or ("normal", std) (models/layers.py
    initial_rules)."""
    if rule[0] in ("zeros", "ones"):
        return torch.full((count,), 0.0 if rule[0] == "zeros" else 1.0, dtype=torch.float32)
    out = torch.empty(count, dtype=torch.float32)
    if count == 0:
        return out
    seed = torch.initial_seed()
    for index in range(start // BLOCK, (start + count - 1) // BLOCK + 1):
        lo, hi = max(start, index * BLOCK), min(start + count, (index + 1) * BLOCK)
        block = _block(seed, name, index, rule[1])
        out[lo - start:hi - start] = block[lo - index * BLOCK:hi - index * BLOCK]
    return out


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
