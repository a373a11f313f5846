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
    assert manifest.verify(final).startswith("rank1.bin: CRC-32 ")
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
        with WriteProgress(store, index, [path], world=2, interval_s=0.1):
            with open(path, "wb") as f:
                for _ in range(chunks):
                    f.write(b"x" * 4096)
                    f.flush()
                    time.sleep(0.25)

    for prefix, chunks, stalls in (("slow/", 10, False), ("stalled/", 1, True)):
        store0, store1 = dist.PrefixStore(prefix, server), dist.PrefixStore(prefix, client)
        if stalls:  # rank 1 reported once, then nothing (a dead process, a stuck fsync)
            store1.set("writing/1", "1")
            store1.add("progress", 4096)
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
            assert str(e.value).startswith("checkpoint step_00000001: rank(s) 1 made no "
                                           "progress writing their files for 1 s; ")
        else:
            wait_for_writers(store0, 2, "checkpoint step_00000001", stall_s=1.0, interval_s=0.2)
            waited = time.monotonic() - t0
            writer.join()
            assert waited >= 1.8, waited  # rank 1 wrote for 2.5 s, rank 0 for 0.25 of them
            assert (tmp_path / "slow.bin").stat().st_size == 10 * 4096


def test_store_requests_per_rank_per_save_do_not_grow_with_the_world(tmp_path):
    """The confirmation's traffic, counted on real gloo groups of 4 and 8 ranks whose last rank
    starts each save 2 s late (the others wait through ten 0.2 s slices): per rank per save a
    few requests a slice, the same at 8 ranks as at 4 (polling every lagging rank each slice
    made it grow with N: 58 at 4 ranks, 94 at 8, measured). The resume check afterwards: each rank
    checksums its share (together: every file once) and one all-reduce finds them intact."""
    import json

    counts = {}
    for world in (4, 8):
        out = tmp_path / f"result{world}"
        run_rank_script("store_traffic.py", world, tmp_path / f"ckpt{world}", out, 2.0, 4,
                        timeout=240)
        results = [json.loads((tmp_path / f"result{world}.{r}").read_text())
                   for r in range(world)]
        counts[world] = max(max(r["requests_per_save"]) for r in results)
        assert all(r["fault"] == world for r in results)  # nobody found a fault
        shares = sorted(f for r in results for f in r["share"])
        assert shares == sorted(f"rank{r}.bin" for r in range(world))  # each file once
    print("store requests per rank per save:", counts)
    assert counts[4] <= 40 and counts[8] <= counts[4] + 8, counts


def test_the_resume_check_shares_files_by_bytes():
    """manifest.share: every file in exactly one rank's share, the largest first to the rank
    with the fewest bytes; no share exceeds an even split by more than the largest file."""
    sizes = [900, 500, 400, 300, 300, 200, 100, 100, 50, 10]
    body = {"files": {f"f{i}": {"bytes": b, "crc32": "0"} for i, b in enumerate(sizes)}}
    for world in (1, 3, 4, 16):
        shares = [manifest.share(body, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(body["files"])
        loads = [sum(body["files"][n]["bytes"] for n in s) for s in shares]
        assert max(loads) <= sum(sizes) / world + max(sizes), (world, loads)
    assert manifest.share(body, 0, 3) == ["f0", "f7"]  # 900, then a 100 at a three-way tie
