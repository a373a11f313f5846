"""A checkpoint's manifest, and the check that the checkpoint to resume from is whole.

Every rank checksums the files it wrote, after its fsync, while they are still in the page cache;
rank 0 gathers the lists and writes `manifest.json` (files, sizes, CRC-32s, layout, step,
samples) as the last file of the staging folder, before the folder is renamed into place. So a
checkpoint folder without its manifest is one written before manifests existed, never a partial
one.

Before a resume (before any process group), every rank walks the checkpoints newest first and
takes the first that is intact: each rank compares the sizes itself (a stat per file), and global
rank 0 compares the checksums, reading the files in parallel threads, and leaves its verdict
beside the manifest (`verified.json`), which the other ranks wait for. The verdict is kept: a
requeued job does not read a verified checkpoint again. CRC-32 rather than a cryptographic hash:
it guards against torn and damaged files, not against tampering, and zlib's runs at 2.2 GiB/s on
one core of this project's CPUs (SHA-256: 1.4), releasing the GIL, so threads overlap; reading
a rank's just-written files back and checksumming them ran at 1.0 GB/s.
"""
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from dr_scale.errors import DrScaleError
from dr_scale.checkpoint.layout import write_atomic

MANIFEST = "manifest.json"
VERDICT = "verified.json"
FORMAT = 1
_BLOCK = 8 << 20


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def describe(files: List[Path], root: Path) -> Dict[str, dict]:
    """{path under `root`: {"bytes", "crc32"}} of this rank's files."""
    return {str(Path(f).relative_to(root)): {"bytes": Path(f).stat().st_size,
                                             "crc32": crc32_of(Path(f))} for f in files}


def write(tag_dir: Path, files: Dict[str, dict], step: int, consumed_samples: int,
          layout: dict) -> Path:
    """The manifest of `tag_dir`, written whole and fsynced (the caller renames the folder)."""
    body = {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
            "layout": layout, "files": dict(sorted(files.items()))}
    path = Path(tag_dir) / MANIFEST
    write_atomic(path, json.dumps(body, indent=1))
    return path


def read(tag_dir: Path) -> Optional[dict]:
    """The manifest, or None for a checkpoint written before manifests."""
    path = Path(tag_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        body["files"].items()
        return body
    except (ValueError, KeyError, AttributeError, TypeError):
        raise _Damaged(f"{path.name} unreadable") from None


class _Damaged(Exception):
    """Why a checkpoint is not intact, in a few words."""


def sizes_fault(tag_dir: Path, body: dict) -> Optional[str]:
    for name, entry in body["files"].items():
        try:
            size = (Path(tag_dir) / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, its manifest {entry['bytes']}"
    return None


def checksum_fault(tag_dir: Path, body: dict, workers: int) -> Optional[str]:
    names = sorted(body["files"], key=lambda n: -body["files"][n]["bytes"])  # largest first
    with ThreadPoolExecutor(max(1, workers)) as pool:
        sums = dict(zip(names, pool.map(lambda n: crc32_of(Path(tag_dir) / n), names)))
    for name in sorted(names):
        if sums[name] != body["files"][name]["crc32"]:
            return (f"{name}: CRC-32 {sums[name]}, its manifest {body['files'][name]['crc32']} "
                    "(damaged)")
    return None


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _sizes_checked(tag_dir: Path) -> tuple:
    """(manifest or None, fault or None) from the manifest and a stat per file."""
    try:
        body = read(tag_dir)
    except _Damaged as e:
        return None, str(e)
    return body, body and sizes_fault(tag_dir, body)


def verify(tag_dir: Path, workers: Optional[int] = None, reuse_verdict: bool = True
           ) -> Optional[str]:
    """None when `tag_dir` is intact (or predates manifests), else why not: sizes, then
    checksums (the kept verdict, when there is one and `reuse_verdict`)."""
    tag_dir = Path(tag_dir)
    body, fault = _sizes_checked(tag_dir)
    if body is None or fault:
        return fault
    verdict = tag_dir / VERDICT
    if reuse_verdict and verdict.is_file():
        return json.loads(verdict.read_text()).get("fault")
    fault = checksum_fault(tag_dir, body, workers or default_workers())
    write_atomic(verdict, json.dumps({"fault": fault, "checked_at": time.time()}))
    return fault


def wait_for_verdict(tag_dir: Path, stall_s: int) -> Optional[str]:
    """On the ranks other than 0: the sizes compared here, then rank 0's checksum verdict."""
    tag_dir = Path(tag_dir)
    body, fault = _sizes_checked(tag_dir)
    if body is None or fault:
        return fault
    verdict, start, poll = tag_dir / VERDICT, time.monotonic(), 0.05
    while not verdict.is_file():
        if time.monotonic() - start > stall_s:
            raise DrScaleError(f"{tag_dir}: waited {stall_s} s for rank 0 to check the "
                               f"checkpoint's checksums; check it first with `dr-scale verify "
                               f"--run_dir {tag_dir.parent.parent}`, then resume")
        time.sleep(poll)
        poll = min(1.0, poll * 2)  # a few stats a second per rank, not a storm
    return json.loads(verdict.read_text()).get("fault")
