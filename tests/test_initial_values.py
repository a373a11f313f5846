"""Initial values do not depend on who draws them (models/initial_values.py): a range of the flat
order, a block of rows or of columns equals the same part of the whole tensor's draw, with one
thread or several, bitwise (and written into bf16, rounded once); a part draws only the tiles it
touches."""
import pytest
import torch

from dr_scale.models import initial_values as iv
from dr_scale.models.initial_values import (BLOCK, fill_block, fill_values, initial_block,
                                            initial_value)

RULE = ("normal", 0.02)


@pytest.fixture
def seeded():
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_ranges_and_threads_draw_the_same_numbers(seeded):
    shape = (41, BLOCK + 17)  # tiles of ~BLOCK / 8 columns, ragged at the right and the bottom
    torch.set_num_threads(1)
    whole = initial_value(RULE, shape, "layers.0.w")
    torch.set_num_threads(2)  # hundreds of tiles: drawn by two threads
    assert torch.equal(initial_value(RULE, shape, "layers.0.w"), whole)
    flat = whole.view(-1)
    for start, count in [(0, 5), (100, BLOCK + 3), (3 * BLOCK, 20 * BLOCK), (7, 39 * BLOCK)]:
        part = torch.empty(count, dtype=torch.float32)
        fill_values(RULE, shape, "layers.0.w", start, part)
        assert torch.equal(part, flat[start:start + count]), (start, count)
    # written straight into a bf16 partition: the same numbers, rounded once; ranges inside one
    # row, across two ragged rows, and whole rows with ragged ends
    width = shape[1]
    for start, count in [(5, 9), (width - 3, 10), (width + 7, 3 * width + 11), (0, 2 * width)]:
        part = torch.empty(count, dtype=torch.bfloat16)
        fill_values(RULE, shape, "layers.0.w", start, part)
        assert torch.equal(part, flat[start:start + count].bfloat16()), (start, count)
    block = torch.empty(5, 300, dtype=torch.bfloat16)
    fill_block(RULE, shape, "layers.0.w", range(30, 35), range(1000, 1300), block)
    assert torch.equal(block, whole[30:35, 1000:1300].bfloat16())
    assert not torch.equal(initial_value(RULE, shape, "layers.1.w"), whole)  # by name
    assert abs(float(whole.std()) - 0.02) < 2e-4


@pytest.mark.parametrize("shape", [(512, 4096), (3, 64, 96), (4096,), (7, 13)])
def test_row_and_column_slices_are_the_whole_tensors(seeded, shape):
    whole = initial_value(RULE, shape, "w").view(-1, shape[-1])
    rows, columns = whole.shape
    for parts in (1, 2, 3, 4, 8):  # 3: uneven, the chunks it overlaps are drawn and cut
        width = -(-columns // parts)
        for first in range(0, columns, width):
            cut = range(first, min(columns, first + width))
            assert torch.equal(initial_block(RULE, shape, "w", range(rows), cut),
                               whole[:, cut.start:cut.stop]), (parts, first)
        height = -(-rows // parts)
        for first in range(0, rows, height):
            cut = range(first, min(rows, first + height))
            assert torch.equal(initial_block(RULE, shape, "w", cut, range(columns)),
                               whole[cut.start:cut.stop]), (parts, first)


def test_a_row_parallel_slice_draws_only_its_columns(seeded, monkeypatch):
    """Tensor parallelism of 8 cuts a row-parallel weight's columns: each rank's slice is drawn
    from 1/8 of the tensor's tiles (and 1/4 under TP 4), not the whole tensor's."""
    drawn = []
    real = iv._generator
    monkeypatch.setattr(iv, "_generator", lambda *key: drawn.append(key[2:]) or real(*key))
    shape = (2048, 8192)  # a 70B down projection's shape, fewer rows
    initial_value(RULE, shape, "w")
    every = len(drawn)
    assert every >= 8 * 2 and len(set(drawn)) == every
    for parts in (8, 4):
        drawn.clear()
        initial_block(RULE, shape, "w", range(2048), range(0, 8192 // parts))
        assert len(drawn) == every // parts, parts
