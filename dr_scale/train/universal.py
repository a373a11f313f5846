"""Between ZeRO families in DeepSpeed's universal checkpoint format.

ds_to_universal writes per-parameter fp32 / exp_avg / exp_avg_sq files in two dialects: from
ZeRO-3 a flat tensor per file and no step count; from ZeRO-1/2 {"param": shaped tensor,
"cat_dim": 0} plus step.pt. Each family's loader reads only its own dialect and its own
model-states file names, so resuming ZeRO-3 at ZeRO-1/2 (or back) means rewriting the dialect,
adding the step count and global optimizer keys the other loader asks for, and providing the
model-states files under the names it opens. The values themselves are not touched.
"""
import shutil
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError

# DeepSpeed's own pickles (not ours): loading them needs weights_only=False.
_load = lambda p: torch.load(p, map_location="cpu", weights_only=False)  # noqa: E731


def _param_shapes(model_states: dict) -> dict:
    shapes = {}
    for group in model_states["param_shapes"]:
        shapes.update(group)
    return shapes


def zero3_to_zero12(udir: Path):
    ms = _load(udir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    step = torch.tensor(float(ms["global_steps"] - ms["skipped_steps"]))  # Adam's step count
    for name, shape in _param_shapes(ms).items():
        pdir = udir / "zero" / name
        for f in pdir.glob("*.pt"):
            t = _load(f)
            if isinstance(t, torch.Tensor):
                torch.save({"param": t.view(shape), "cat_dim": 0}, f)
        torch.save(step, pdir / "step.pt")
    opt = _load(udir / "zero" / "optimizer_state.pt")
    opt.setdefault("ds_version", ms["ds_version"])
    torch.save(opt, udir / "zero" / "optimizer_state.pt")
    shutil.copyfile(udir / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                    udir / "mp_rank_00_model_states.pt")


def zero12_to_zero3(udir: Path, world_size: int):
    ms = _load(udir / "mp_rank_00_model_states.pt")
    step = None
    for name in _param_shapes(ms):
        pdir = udir / "zero" / name
        for f in pdir.glob("*.pt"):
            t = _load(f)
            if f.name == "step.pt":
                step = t
                f.unlink()
            elif isinstance(t, dict) and "param" in t:
                torch.save(t["param"].reshape(-1), f)
    opt = _load(udir / "zero" / "optimizer_state.pt")
    opt.setdefault("optimizer_state_dict", {"state": {0: {"step": step}},
                                            "param_groups": opt.get("param_groups", [])})
    torch.save(opt, udir / "zero" / "optimizer_state.pt")
    for rank in range(world_size):
        shutil.copyfile(udir / "mp_rank_00_model_states.pt",
                        udir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def repair_zero3_load(zero3, udir: Path):
    """Two faults of DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`), each of which made a resumed run's
    losses drift from the uninterrupted run's although every tensor loaded was equal:
    - every sub-group's Adam state gets the *same* step tensor, which the optimizer then
      advances once per sub-group each step (bias correction as if many steps had passed):
      each gets its own copy;
    - every parameter group gets the saved first group's hyperparameters (the group without
      weight decay, norms and biases, resumed with weight decay): each gets its own back from
      the same file, as a direct load (torch's load_state_dict) does.
    `zero3`: DeepSpeed's ZeRO-3 optimizer; `udir`: the universal tag folder it loaded."""
    state = zero3.optimizer.state
    for flat in zero3.fp32_partitioned_groups_flat:
        step = state.get(flat, {}).get("step")
        if isinstance(step, torch.Tensor):
            state[flat]["step"] = step.clone()
    path = udir / "zero" / "optimizer_state.pt"
    saved = _load(path)["optimizer_state_dict"]["param_groups"]
    groups = zero3.optimizer.param_groups
    if len(saved) != len(groups):
        raise DrScaleError(f"{path}: {len(saved)} parameter groups saved, this run's optimizer "
                           f"has {len(groups)}")
    for group, own in zip(groups, saved):
        group.update({k: v for k, v in own.items() if k != "params"})
