"""The checkpoint folder stays clean over a week of restarts: a step written again (after a
rollback) replaces its folder by renames and takes its old universal conversions with it; an
earlier job's conversion error cannot stop a later job's waiting ranks; what killed conversions
left is pruned. Real files, the real writer over a one-rank gloo group."""
import os
import threading
import time
import types

import pytest
import torch.distributed as dist

from dr_scale.checkpoint import reshard, writer as writer_module
from dr_scale.checkpoint.layout import STAGING, STATE_FILE, TargetLayout, tag_for, universal_dir
from dr_scale.checkpoint.writer import CheckpointWriter
from dr_scale.errors import DrScaleError
from dr_scale.parallel.topology import Topology


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def publish(writer, ckpt_dir, step: int, content: bytes):
    folder = ckpt_dir / STAGING / tag_for(step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank0.bin").write_bytes(content)
    writer.publish(tag_for(step), [folder / "rank0.bin"], position=(step, 8 * step))


def test_a_step_written_again_replaces_its_folder_and_its_conversions(one_rank_group, tmp_path,
                                                                      monkeypatch):
    ckpt = tmp_path / "checkpoints"
    engine = types.SimpleNamespace(checkpoint_engine=None, zero_optimization_stage=lambda: 1)
    writer = CheckpointWriter(engine, ckpt, Topology(1))
    publish(writer, ckpt, 3, b"first timeline")
    (ckpt / tag_for(3) / "only_in_the_first.bin").write_bytes(b"x")
    for target in (TargetLayout(2, 1), TargetLayout(4, 3)):  # its conversions, then a rollback
        converted = universal_dir(ckpt, target) / tag_for(3)
        converted.mkdir(parents=True)
        (converted / STATE_FILE.format(rank=0)).write_bytes(b"the first timeline's state")
    removed_in_place = []
    real_rmtree = writer_module.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # what is deleted, and under which name
        removed_in_place.append(os.path.basename(path))
        return real_rmtree(path, *args, **kwargs)
    monkeypatch.setattr(writer_module.shutil, "rmtree", rmtree)
    publish(writer, ckpt, 3, b"second timeline")
    writer.finish_deletes()
    assert sorted(p.name for p in (ckpt / tag_for(3)).iterdir()) == ["manifest.json", "rank0.bin"]
    assert (ckpt / tag_for(3) / "rank0.bin").read_bytes() == b"second timeline"
    assert (ckpt / "latest").read_text() == "step_00000003\n"
    assert not list((ckpt / "universal").glob("*/step_*"))  # no old conversion to load later
    assert not list(ckpt.rglob(".deleting-*"))
    # nothing named as a checkpoint was ever deleted in place (a kill mid-delete would have
    # left a half-deleted folder under the step's name)
    assert removed_in_place and all(n.startswith(".deleting-") for n in removed_in_place)


def test_an_earlier_jobs_conversion_error_does_not_stop_a_waiting_rank(tmp_path):
    ckpt, tag, target = tmp_path / "checkpoints", tag_for(6), TargetLayout(2, 3)
    out = universal_dir(ckpt, target)
    out.mkdir(parents=True)
    note = out / reshard.FAILED.format(tag=tag)
    note.write_text("an earlier job's conversion failed\n")
    hour_ago = time.time() - 3600
    os.utime(note, (hour_ago, hour_ago))

    def rank0_converts():  # this job's rank 0, a moment later
        time.sleep(0.5)
        (out / tag).mkdir()
        (out / tag / STATE_FILE.format(rank=0)).write_bytes(b"state")
    converter = threading.Thread(target=rank0_converts)
    converter.start()
    reshard.wait_for_universal(ckpt, tag, target, stall_s=30, poll_s=0.05)
    converter.join()
    # this job's own error line still stops its waiting ranks at once, with that line
    other = tag_for(9)
    (out / reshard.FAILED.format(tag=other)).write_text("this job's conversion failed\n")
    with pytest.raises(DrScaleError, match="^this job's conversion failed$"):
        reshard.wait_for_universal(ckpt, other, target, stall_s=30, poll_s=0.05)


def test_what_killed_conversions_left_is_pruned(tmp_path):
    ckpt = tmp_path / "checkpoints"
    kept = universal_dir(ckpt, TargetLayout(2, 1)) / tag_for(3) / STATE_FILE.format(rank=0)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"a whole conversion")
    half = universal_dir(ckpt, TargetLayout(4, 3)) / reshard.CONVERTING.format(tag=tag_for(6))
    (half / "zero").mkdir(parents=True)
    (half / "zero" / "fp32.pt").write_bytes(b"\0" * 4096)
    note = universal_dir(ckpt, TargetLayout(4, 3)) / reshard.FAILED.format(tag=tag_for(6))
    note.write_text("an earlier job's conversion failed\n")
    assert sorted(p.name for p in reshard.prune_leftovers(ckpt)) == [note.name, half.name]
    assert not half.exists() and not note.exists() and kept.read_bytes() == b"a whole conversion"
