"""The run folder's record of how to reproduce the run."""
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import yaml

PACKAGES = ("torch", "deepspeed", "numpy", "sentencepiece", "pyyaml", "triton", "megatron-core",
            "transformers", "wandb", "dr_scale")


def git_state(repo: Path) -> dict:
    def run(*args):
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = run("rev-parse", "HEAD")
    return {"commit": commit or None, "dirty": bool(run("status", "--porcelain")) if commit else None}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_snapshot(run_dir: Path, cfg, ds_config: dict, extra: dict):
    """config.yaml (resolved, loadable with --config), ds_config.json (resolved), run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    info = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
            "command": [sys.executable] + sys.argv,
            "git": git_state(Path(__file__).resolve().parents[2]),
            "packages": package_versions(),
            "environment": {k: v for k, v in os.environ.items()
                            if k.startswith(("OMP_", "MASTER_", "WORLD_SIZE", "LOCAL_SIZE",
                                             "CUDA_VISIBLE", "DR_SCALE"))}}
    info.update(extra)
    (run_dir / "run.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
