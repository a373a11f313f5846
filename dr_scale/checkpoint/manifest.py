"""A checkpoint's manifest, and the checks that a checkpoint is whole.

Every rank checksums the files it wrote, after its fsync, while they are still in the page cache;
rank 0 gathers the lists and writes `manifest.json` (files, sizes, CRC-32s, layout, step,
samples) as the last file of the staging folder, before the folder is renamed into place. So the
verdict of the save is part of the published checkpoint, and a checkpoint folder without its
manifest is one written before manifests existed, never a partial one.

A resume checks the files again, in parallel: each rank its share (`share`: the files balanced
by bytes over the ranks, the same split on every rank), sizes then checksums, and the ranks
agree in one collective (checkpoint/agree.py). No rank reads another's files, so the time falls
with the number of ranks for a checkpoint of a given size, and nothing waits on a fixed
deadline for one reader. A checkpoint found damaged gets a note (`damaged.json`) so no later
attempt plans from it again. `verify` (one process, threads) serves `dr-scale verify` and
export. CRC-32 rather than a cryptographic hash: it guards against torn and damaged files, not
against tampering, and zlib's runs at 2.2 GiB/s on one core of this project's CPUs (SHA-256:
1.4), releasing the GIL, so threads overlap; reading a rank's just-written files back and
checksumming them ran at 1.0 GB/s.
"""
import heapq
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from dr_scale.checkpoint.layout import write_atomic

MANIFEST = "manifest.json"
DAMAGED = "damaged.json"  # the fault a resume found, kept: later attempts skip it
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


def sizes_fault(tag_dir: Path, body: dict, names=None) -> Optional[str]:
    for name in sorted(body["files"]) if names is None else names:
        entry = body["files"][name]
        try:
            size = (Path(tag_dir) / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, its manifest {entry['bytes']}"
    return None


def checksum_fault(tag_dir: Path, body: dict, workers: int, names=None) -> Optional[str]:
    names = sorted(body["files"] if names is None else names,
                   key=lambda n: -body["files"][n]["bytes"])  # largest first
    with ThreadPoolExecutor(max(1, workers)) as pool:
        sums = dict(zip(names, pool.map(lambda n: crc32_of(Path(tag_dir) / n), names)))
    for name in sorted(names):
        if sums[name] != body["files"][name]["crc32"]:
            return (f"{name}: CRC-32 {sums[name]}, its manifest {body['files'][name]['crc32']} "
                    "(damaged)")
    return None


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def share(body: dict, rank: int, world: int) -> List[str]:
    """The files rank `rank` of `world` checks: the largest first, each to the rank with the
    fewest bytes so far (ties to the lower rank); every rank computes the same split."""
    load = [(0, r) for r in range(world)]  # a heap: (bytes so far, rank), the least on top
    mine = []
    for name in sorted(body["files"], key=lambda n: (-body["files"][n]["bytes"], n)):
        bytes_so_far, r = heapq.heappop(load)
        heapq.heappush(load, (bytes_so_far + body["files"][name]["bytes"], r))
        if r == rank:
            mine.append(name)
    return mine


def share_fault(tag_dir: Path, body: dict, rank: int, world: int, workers: int = 2
                ) -> Optional[str]:
    """Why this rank's share of `tag_dir` is not intact (a missing or short file, a checksum
    that differs), or None. An OSError other than a missing file is raised: a fault of the
    storage, not of the checkpoint."""
    names = share(body, rank, world)
    return sizes_fault(tag_dir, body, names) or checksum_fault(tag_dir, body, workers, names)


def read_for_resume(tag_dir: Path) -> tuple:
    """(manifest or None, why the checkpoint cannot be resumed from or None), from the manifest
    and an earlier resume's note; nothing else is read."""
    tag_dir = Path(tag_dir)
    noted = tag_dir / DAMAGED
    if noted.is_file():
        try:
            return None, json.loads(noted.read_text())["fault"] + " (found by an earlier resume)"
        except (ValueError, KeyError, TypeError):
            return None, f"{DAMAGED} says it is damaged"
    try:
        return read(tag_dir), None
    except _Damaged as e:
        return None, str(e)


def mark_damaged(tag_dir: Path, fault: str):
    """Keep what a resume found, so no later attempt plans from this checkpoint again."""
    write_atomic(Path(tag_dir) / DAMAGED, json.dumps({"fault": fault, "found_at": time.time()}))


def verify(tag_dir: Path, workers: Optional[int] = None) -> Optional[str]:
    """None when `tag_dir` is intact (or predates manifests), else why not: sizes, then every
    checksum, read by this process in `workers` threads."""
    tag_dir = Path(tag_dir)
    try:
        body = read(tag_dir)
    except _Damaged as e:
        return str(e)
    if body is None:
        return None
    return sizes_fault(tag_dir, body) or checksum_fault(tag_dir, body,
                                                        workers or default_workers())
