"""Checkpoint publication over a real 2-rank gloo group: every rank fsyncs its own files, the
checkpoint is renamed and named in `latest` only when all ranks confirm, old ones go after (in a
thread of their own)."""
import json
import zlib

from dr_scale.checkpoint import manifest

from tests.conftest import run_rank_script


def test_latest_moves_only_when_every_rank_confirms(tmp_path):
    ckpt, out = tmp_path / "checkpoints", tmp_path / "result"
    run_rank_script("checkpoint_commit.py", ckpt, out, timeout=120)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result.{rank}").read_text())
        assert [r[str(s)] for s in (1, 2, 3)] == ["published"] * 3
        assert [r[f"latest_after_{s}"] for s in (1, 2, 3)] == [
            "step_00000001", "step_00000002", "step_00000003"]
        assert r["kept_after_3"] == ["step_00000002", "step_00000003"]  # keep_last=2
        # rank 1 lost its file at step 4: both ranks fail in one line, latest stays at 3
        assert r["4"].startswith("checkpoint step_00000004: ")
        assert "latest still names the previous checkpoint" in r["4"]
        assert r["latest_after_4"] == "step_00000003"
        assert r["kept_after_4"] == ["step_00000002", "step_00000003"]
        # pruned ones were renamed aside at once, then deleted by a thread of rank 0's, with
        # the folder an earlier process had set aside
        assert r["set_aside_left"] == []
    rank1 = json.loads((tmp_path / "result.1").read_text())
    assert "rank1.bin: No such file or directory" in rank1["4"]  # names the file it lost
    final = ckpt / "step_00000003"
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "rank0.bin", "rank1.bin"]
    assert (final / "rank1.bin").read_bytes() == bytes([1, 3]) * 1000
    # the manifest: every rank's file with its size and CRC-32 (zlib's, computed here again)
    body = json.loads((final / "manifest.json").read_text())
    assert body["files"] == {f"rank{r}.bin": {"bytes": 2000, "crc32": f"{zlib.crc32(bytes([r, 3]) * 1000):08x}"}
                             for r in (0, 1)}
    assert (body["step"], body["consumed_samples"]) == (3, 24)
    assert body["layout"] == {"world": 2, "tensor": 1, "pipeline": 1, "zero_stage": 1}
    assert manifest.verify(final) is None
    (final / "rank1.bin").write_bytes(bytes([1, 4]) * 1000)  # same size, other bytes
    # the kept verdict serves a requeue without reading again; a fresh check sees the change
    assert manifest.verify(final) is None
    assert manifest.verify(final, reuse_verdict=False).startswith("rank1.bin: CRC-32 ")
    assert (ckpt / ".incoming" / "step_00000004" / "rank0.bin").exists()  # not published


def test_the_confirmation_waits_for_a_slow_writer_and_names_a_stalled_one(tmp_path):
    """write_progress over a real TCPStore (the job's store kind): rank 0 waits for rank 1,
    whose file grows for 2.5 s, longer than the 1 s stall limit, because it keeps growing; a
    rank whose file stops growing is named within the limit plus one reporting interval."""
    import socket
    import threading
    import time
    from datetime import timedelta

    import pytest
    import torch.distributed as dist

    from dr_scale.errors import DrScaleError
    from dr_scale.checkpoint.write_progress import WriteProgress, wait_for_writers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))

    def rank(store, name, index, chunks):
        path = tmp_path / name
        with WriteProgress(store, index, [path], interval_s=0.1):
            with open(path, "wb") as f:
                for _ in range(chunks):
                    f.write(b"x" * 4096)
                    f.flush()
                    time.sleep(0.25)

    for prefix, chunks, stalls in (("slow/", 10, False), ("stalled/", 1, True)):
        store0, store1 = dist.PrefixStore(prefix, server), dist.PrefixStore(prefix, client)
        if stalls:  # rank 1 reported once, then nothing (a dead process, a stuck fsync)
            store1.set("progress/1", "4096")
        else:
            writer = threading.Thread(target=rank, args=(store1, "slow.bin", 1, chunks))
            writer.start()
        rank(store0, "rank0.bin", 0, 1)
        t0 = time.monotonic()
        if stalls:
            with pytest.raises(DrScaleError) as e:
                wait_for_writers(store0, 2, "checkpoint step_00000001", stall_s=1.0,
                                 interval_s=0.2)
            waited = time.monotonic() - t0
            assert 1.0 <= waited < 2.5, waited
            assert str(e.value).startswith("checkpoint step_00000001: rank 1 made no progress "
                                           "writing its files for 1 s (at 0.0 MiB)")
        else:
            wait_for_writers(store0, 2, "checkpoint step_00000001", stall_s=1.0, interval_s=0.2)
            waited = time.monotonic() - t0
            writer.join()
            assert waited >= 1.8, waited  # rank 1 wrote for 2.5 s, rank 0 for 0.25 of them
            assert (tmp_path / "slow.bin").stat().st_size == 10 * 4096
