"""The host snapshot an asynchronous save writes from (checkpoint/snapshot.py): the same bytes on disk
as the live state, views of one storage still one storage, independent of later changes, and its
buffers mapped once and reused."""
import io

import torch

from dr_scale.checkpoint.snapshot import SnapshotBuffers, host_snapshot, populated_buffers


def _state():
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    return {"module": {"a": flat[:600].view(20, 30), "b": flat[600:]},  # views of one buffer
            "optimizer": {"state": [{"exp_avg": torch.ones(7, dtype=torch.bfloat16), "step": 3}],
                          "lr": 1e-3, "names": ("a", "b")},
            "empty": torch.empty(0)}


def _saved(obj) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def test_snapshot_writes_the_same_bytes_and_keeps_views_shared():
    state = _state()
    before = _saved(state)
    copy = host_snapshot(state, buffers=SnapshotBuffers())
    assert _saved(copy) == before  # same structure, values and storage sharing
    a, b = copy["module"]["a"], copy["module"]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != state["module"]["a"].untyped_storage().data_ptr()
    state["module"]["a"].add_(1.0)  # training goes on: the copy does not change
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    assert _saved(copy) == before


def test_second_snapshot_reuses_the_first_ones_buffers():
    buffers = SnapshotBuffers()
    state = _state()
    first = host_snapshot(state, buffers=buffers)
    pointers = {first["module"]["a"].untyped_storage().data_ptr(),
                first["optimizer"]["state"][0]["exp_avg"].untyped_storage().data_ptr()}
    del first
    state["module"]["b"].mul_(2.0)
    second = host_snapshot(state, buffers=buffers)
    assert {second["module"]["a"].untyped_storage().data_ptr(),
            second["optimizer"]["state"][0]["exp_avg"].untyped_storage().data_ptr()} == pointers
    assert torch.equal(second["module"]["b"], state["module"]["b"])


def test_synchronous_snapshot_shares_cpu_storages():
    state = _state()
    copy = host_snapshot(state, clone_cpu=False)
    assert copy["module"]["a"].data_ptr() == state["module"]["a"].data_ptr()


def test_populated_buffers_have_their_own_sizes():
    sizes = [1, 0, 4096, 100]
    storages = populated_buffers(sizes)
    assert [s.nbytes() for s in storages] == sizes
    pointers = [s.data_ptr() for s in storages if s.nbytes()]
    assert all(p % 64 == 0 for p in pointers) and len(set(pointers)) == 3
    t = torch.empty(0, dtype=torch.uint8).set_(storages[2])
    t.fill_(7)  # writable, and a save holds this storage's bytes only: as a plain tensor's
    assert _saved(t) == _saved(torch.full((4096,), 7, dtype=torch.uint8))


def test_prepared_buffers_serve_the_first_snapshot():
    buffers = SnapshotBuffers()
    state = _state()
    buffers.prepare(state)  # mapped in a thread
    prepared = {k: [s.data_ptr() for s in v] for k, v in buffers.reuse().items()}
    assert sorted(prepared) == [(0, False), (14, False), (4000, False)]  # the storages copied
    buffers = SnapshotBuffers()
    buffers.prepare(state)
    before = _saved(state)
    copy = host_snapshot(state, buffers=buffers)
    assert _saved(copy) == before
    mapped = {s.data_ptr() for v in buffers._kept.values() for s in v}
    assert copy["module"]["a"].untyped_storage().data_ptr() in mapped


def test_populated_in_the_background_too():
    storages = populated_buffers([3 * 64 * 2**20 + 5, 7], background=True)  # several chunks
    t = torch.empty(0, dtype=torch.uint8).set_(storages[0])
    assert t.nbytes == 3 * 64 * 2**20 + 5 and int(t[::4096].sum()) == 0  # zeroed pages
