"""Small JSON caches of measured facts under $DR_SCALE_CACHE (default ~/.cache/dr_scale): the CPU
peak FLOP/s and the kernels chosen by measurement. A damaged or absent file is an empty cache
(measured again and rewritten); writes replace the file whole, so ranks writing at once never
leave it torn; an unwritable cache costs only the measurement next time."""
import json
import os
from pathlib import Path


def cache_file(name: str) -> Path:
    root = os.environ.get("DR_SCALE_CACHE") or "~/.cache/dr_scale"
    return Path(root).expanduser() / name


def read(name: str) -> dict:
    try:
        return json.loads(cache_file(name).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def store(name: str, key: str, value) -> None:
    cache = read(name)
    cache[key] = value
    path = cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
