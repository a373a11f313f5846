"""DeepSpeed compiles its C++ ops (CPU Adam, async I/O, the CPU collectives) on first use through
torch's cpp_extension, in torch's extension folder, and a build holds a `lock` file there while
it runs. A build that is killed (a timeout, Ctrl-C, the OOM killer) leaves the file behind, and
every later process that loads the op waits for it to go: forever, without a word (seen here: a
ZeRO-3 offload run hung at DeepSpeedCPUAdam after an earlier run was killed mid-build). The
launcher names such files at start, before any rank loads an op.
"""
import os
import time
from pathlib import Path
from typing import List


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its default (one subfolder per
    Python and CUDA version, one folder per op below it)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def lock_warnings() -> List[str]:
    """A line for each op build lock that exists now."""
    now = time.time()
    lines = []
    for lock in sorted(extensions_root().glob("*/*/lock")):
        try:
            minutes = (now - lock.stat().st_mtime) / 60
        except OSError:  # gone while we looked: that build finished
            continue
        lines.append(f"{lock} is {minutes:.0f} min old: a build of the `{lock.parent.name}` op "
                     f"holds it, or a killed one left it; DeepSpeed waits, silently, until it is "
                     f"gone: delete it if no build is running")
    return lines
