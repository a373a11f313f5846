"""The host memory a node's ranks share, measured once per node, before any process group.

Each rank measuring MemAvailable itself saw its siblings' start-up as memory already taken:
at 32 ranks on one node (benchmarks/rehearsal.py) the ranks that planned later saw up to 15%
less, and the memory check answered some ranks "train.release_host_memory=true fits" and others
"nothing fits": one configuration, several different one-line refusals. So the node's first
local rank measures and leaves the figure in a small file named after the ranks' common parent
process (the launcher, srun's step daemon or torchrun's agent: one per attempt), and the
others read it; a rank that finds none within `wait_s` (another launcher layout) measures
itself. The file is removed when the process group has started (`forget`); an attempt the plan
refused leaves its few bytes in /dev/shm (the other ranks may still be reading them then).
"""
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from dr_scale.runtime.ranks import local_rank


def _path() -> Optional[Path]:
    import psutil

    parent = psutil.Process().parent()
    if parent is None:
        return None
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return folder / f"dr_scale_node_memory_{parent.pid}_{int(parent.create_time())}"


def available_bytes(ranks_here: int, wait_s: float = 60.0) -> int:
    """MemAvailable as the node's local rank 0 measured it (every rank of the node gets the
    same figure); a single rank on its node measures itself."""
    import psutil

    path = _path() if ranks_here > 1 else None
    if path is None:
        return psutil.virtual_memory().available
    if local_rank() == 0:
        value = psutil.virtual_memory().available
        tmp = path.with_name(path.name + f".{os.getpid()}")
        tmp.write_text(str(value))
        os.replace(tmp, path)
        return value
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    return psutil.virtual_memory().available


def forget():
    """Local rank 0 removes the figure once every rank has planned (the group has started)."""
    if local_rank() == 0:
        path = _path()
        if path is not None:
            path.unlink(missing_ok=True)
