"""The CUDA extension built once per node: local rank 0 builds, the node's other ranks wait for its
result (with a timeout and a message that says what they wait for) and then load the built module.

torch.utils.cpp_extension guards a build folder with a lock file that a killed build leaves
behind; every later build then waits on it forever, silently. Local rank 0 records who builds
(host, pid) beside it, so a lock whose builder is gone is found, named and removed; a lock with no
record (a build outside dr_scale) is taken as stale once older than the build timeout.

The result (built, or the compiler's error with the log's path) is written for this job only: the
marker carries the job (host and the launcher's pid, which a node's ranks share) and a digest of the
sources, so a marker from another job or older sources is never read as this one's.
"""
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, List, Optional

BUILD_TIMEOUT_S = float(os.environ.get("DR_SCALE_CUDA_BUILD_TIMEOUT", "900"))
POLL_S = 0.5


class BuildFailed(RuntimeError):
    """The extension did not build (here or on local rank 0): one line, the log's path in it."""


def build_once(build: Callable[[], object], build_dir: Path, sources: List[Path],
               local_rank: int, timeout_s: float = BUILD_TIMEOUT_S, say=print):
    """`build()` on local rank 0, its result shared through `build_dir`; the other local ranks
    wait for it, then call `build()` themselves (which only loads what rank 0 built)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    job = {"job": f"{socket.gethostname()}:{os.getppid()}", "sources": digest(sources)}
    if local_rank == 0:
        return _build_here(build, build_dir, job, timeout_s, say)
    result = _wait_for(build_dir, job, timeout_s)
    if not result["ok"]:
        raise BuildFailed(result["error"])
    return build()


def digest(sources: List[Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for path in sources:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def _build_here(build, build_dir: Path, job: dict, timeout_s: float, say):
    result_file = build_dir / "dr_scale_build_result.json"
    result_file.unlink(missing_ok=True)
    _clear_stale_lock(build_dir, timeout_s, say)
    _builder_file(build_dir).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
    try:
        module = build()
    except Exception as e:
        log = build_dir / "dr_scale_build.log"
        log.write_text(str(e))
        error = f"the CUDA extension did not build: {first_error(str(e))} (full log: {log})"
        _write_result(result_file, dict(job, ok=False, error=error))
        raise BuildFailed(error) from None
    finally:
        _builder_file(build_dir).unlink(missing_ok=True)
    _write_result(result_file, dict(job, ok=True))
    return module


def _wait_for(build_dir: Path, job: dict, timeout_s: float) -> dict:
    result_file = build_dir / "dr_scale_build_result.json"
    start = time.monotonic()
    while True:
        result = _read(result_file)
        if result and all(result.get(k) == v for k, v in job.items()):
            return result
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise BuildFailed(
                f"waited {waited:.0f} s for local rank 0 to build the CUDA extension in "
                f"{build_dir} ({_holder(build_dir)}); raise DR_SCALE_CUDA_BUILD_TIMEOUT if the "
                f"build is that slow, or force model.kernels=torch for the fused ops")
        time.sleep(POLL_S)


def _clear_stale_lock(build_dir: Path, timeout_s: float, say):
    """Wait for a live build of the same folder (another job on this node); remove a lock that
    no live build holds, saying whose it was."""
    lock = build_dir / "lock"
    start = time.monotonic()
    while lock.exists():
        builder = _read(_builder_file(build_dir))
        if builder is not None:
            if builder.get("host") == socket.gethostname() and not _alive(builder.get("pid")):
                return _remove_stale(lock, build_dir, say,
                                     f"left by pid {builder['pid']}, which is no longer running")
        else:
            age = time.time() - _mtime(lock)
            if age > timeout_s:
                return _remove_stale(lock, build_dir, say,
                                     f"{age:.0f} s old, no build recorded as holding it")
        if time.monotonic() - start > timeout_s:
            raise BuildFailed(f"the CUDA extension's build folder {build_dir} stayed locked "
                              f"for {timeout_s:.0f} s ({_holder(build_dir)})")
        time.sleep(POLL_S)


def _remove_stale(lock: Path, build_dir: Path, say, why: str):
    say(f"dr_scale: removed a stale CUDA build lock {lock} ({why})")
    lock.unlink(missing_ok=True)
    _builder_file(build_dir).unlink(missing_ok=True)


def _holder(build_dir: Path) -> str:
    lock = build_dir / "lock"
    builder = _read(_builder_file(build_dir))
    if builder:
        state = "running" if _alive(builder.get("pid")) else "no longer running"
        return f"building: pid {builder.get('pid')} on {builder.get('host')}, {state}"
    if lock.exists():
        return f"lock {lock} held, {time.time() - _mtime(lock):.0f} s old, by no recorded build"
    return "no build has started: is local rank 0 alive?"


def first_error(text: str) -> str:
    """The compiler's first error line, else the message's first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.lower().startswith("error building extension"):
            return line[:300]
    return (lines or ["unknown error"])[0][:300]


def _builder_file(build_dir: Path) -> Path:
    return build_dir / "dr_scale_builder.json"


def _write_result(path: Path, result: dict):
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)  # a waiting rank never reads half a result


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
