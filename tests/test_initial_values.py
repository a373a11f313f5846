"""Initial values do not depend on who draws them (models/initial_values.py): a range equals the
same slice of the whole tensor's draw, with one thread or several, bitwise."""
import torch

from dr_scale.models.initial_values import BLOCK, initial_values

RULE = ("normal", 0.02)


def test_ranges_and_threads_draw_the_same_numbers():
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = initial_values(RULE, "layers.0.w", 0, 40 * BLOCK + 17)
        torch.set_num_threads(2)  # 41 blocks: drawn by two threads
        assert torch.equal(initial_values(RULE, "layers.0.w", 0, 40 * BLOCK + 17), whole)
        for start, count in [(0, 5), (100, BLOCK + 3), (3 * BLOCK, 20 * BLOCK), (7, 39 * BLOCK)]:
            assert torch.equal(initial_values(RULE, "layers.0.w", start, count),
                               whole[start:start + count]), (start, count)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(initial_values(RULE, "layers.1.w", 0, 5), whole[:5])  # by name
    assert abs(float(whole.std()) - 0.02) < 2e-4
