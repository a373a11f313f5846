"""Checkpoints: DeepSpeed's files (model, optimizer, scheduler; ZeRO shards) plus our own state
per rank (step, data position, RNG states, callbacks) in a file loaded with weights_only."""
import random
from pathlib import Path

import numpy as np
import torch

from dr_scale.errors import DrScaleError

STATE_FILE = "dr_scale_state_rank{rank}.pt"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
    }


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32),
                         state["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"].tolist()), None))


def save(engine, ckpt_dir: Path, step: int, state: dict, rank: int) -> Path:
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"dr_scale_step": step})
    path = Path(ckpt_dir) / tag
    torch.save(state, path / STATE_FILE.format(rank=rank))
    torch.distributed.barrier()
    return path


def latest_tag(ckpt_dir: Path):
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    return latest.read_text().strip()


def load(engine, ckpt_dir: Path, rank: int):
    """Load the latest checkpoint into ``engine``; returns (our state dict, path)."""
    ckpt_dir = Path(ckpt_dir)
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise DrScaleError(f"{ckpt_dir}: --resume found no checkpoint (no 'latest' file)")
    path = ckpt_dir / tag
    state_path = path / STATE_FILE.format(rank=rank)
    if not state_path.is_file():
        raise DrScaleError(f"{state_path}: missing; the checkpoint in {path} was not written "
                           "completely or by this number of ranks")
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if load_path is None:
        raise DrScaleError(f"{path}: DeepSpeed could not load this checkpoint")
    try:
        state = torch.load(state_path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise DrScaleError(f"{state_path}: unreadable trainer state ({type(e).__name__})") from None
    return state, path
