"""Reading a checkpoint into a DeepSpeed engine: directly, or through the universal form made
for this layout (resume.py), with the shape it was written for checked first."""
import shutil
from pathlib import Path
from typing import Optional

import torch

from dr_scale.checkpoint import muon_state
from dr_scale.checkpoint.layout import (REHEARSAL, STAGING, STATE_FILE, TargetLayout, find_tag,
                                        refuse_other_shape, saved_buffers,
                                        universal_dir)
from dr_scale.checkpoint.universal import repair_zero3_load
from dr_scale.errors import DrScaleError
from dr_scale.runtime import nvme_offload


def load(engine, ckpt_dir: Path, topology, expected_model: dict, plan: str = "direct",
         target_stage: int = 0, tag: Optional[str] = None):
    """Load checkpoint `tag` (default: the latest) into ``engine``; returns (our state dict,
    path). With a changed number of ranks every rank takes rank 0's state (all ranks' states are
    equal: one seed, data position by step)."""
    ckpt_dir = Path(ckpt_dir)
    rank = topology.rank
    tag = tag or find_tag(ckpt_dir)
    path = ckpt_dir / tag
    load_dir = (universal_dir(ckpt_dir, TargetLayout.of(topology, target_stage))
                if plan == "universal" else ckpt_dir)
    own = load_dir / tag / STATE_FILE.format(rank=rank)
    state_path = own if own.is_file() else load_dir / tag / STATE_FILE.format(rank=0)
    try:
        state = torch.load(state_path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise DrScaleError(f"{state_path}: unreadable trainer state ({type(e).__name__})") from None
    refuse_other_shape(path, state.get("model"), expected_model)
    if rank == 0:
        for leftover in (STAGING, REHEARSAL):  # of a crashed save
            shutil.rmtree(ckpt_dir / leftover, ignore_errors=True)
    try:
        load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag)
    except Exception as e:  # noqa: BLE001 - DeepSpeed raises many kinds on a bad file
        raise DrScaleError(f"{path}: DeepSpeed could not load it ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    if load_path is None:
        raise DrScaleError(f"{path}: DeepSpeed could not load this checkpoint")
    if plan == "universal" and target_stage == 3:
        repair_zero3_load(engine.optimizer, load_dir / tag)
    if plan == "universal":
        muon_state.restore_momentum(engine, load_dir / tag)
        _restore_buffers(engine, path)
    nvme_offload.restore_optimizer_state(engine, load_dir, tag)
    return state, path


def _restore_buffers(engine, tag_dir: Path):
    """The saved buffers (a mixture of experts' routing biases), which DeepSpeed's universal
    load leaves as the model was built (measured: EP 2 -> 1 rank and EP 2 ZeRO-3 on 2 -> 4 ranks
    resumed with zero biases): copied from the checkpoint by name (every rank holds them whole).
    Nothing is read for a model without saved buffers."""
    own = {f"{prefix}.{name}" if prefix else name: buf
           for prefix, module in engine.module.named_modules()
           for name, buf in module._buffers.items()
           if buf is not None and name not in module._non_persistent_buffers_set}
    if not own:
        return
    with torch.no_grad():
        for name, value in saved_buffers(tag_dir).items():
            if name in own:
                own[name].copy_(value.to(own[name].dtype))
