"""One full fp32 state dict from a DeepSpeed checkpoint of any ZeRO stage."""
import json
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError
from dr_scale.models import build_model
from dr_scale.models.build import ModelShape


def run_shape(run_dir: Path) -> ModelShape:
    info_path = run_dir / "run.json"
    if not info_path.is_file():
        raise DrScaleError(f"{info_path}: not found; expected a run folder made by "
                           "launchers/pretrain.py")
    try:
        return ModelShape(**json.loads(info_path.read_text())["model"]["shape"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DrScaleError(f"{info_path}: unreadable model shape ({type(e).__name__})") from None


def _zero0_state(tag_dir: Path, shape: ModelShape) -> dict:
    """ZeRO-0 keeps one file; with bf16/fp16 its fp32 master copies sit in the optimizer's
    fp32_groups, in the order of launch.param_groups (matrices, then vectors)."""
    from dr_scale.launch import param_groups

    files = list(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise DrScaleError(f"{tag_dir}: no DeepSpeed model states file (truncated or foreign "
                           "checkpoint)")
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    module = sd["module"]
    groups = (sd.get("optimizer") or {}).get("fp32_groups")
    if not groups:
        return {k: v.float() for k, v in module.items()}
    model = build_model(shape, device="meta")
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = dict(module)
    for group, masters in zip(param_groups(model, 0.0), groups):
        for p, master in zip(group["params"], masters):
            out[name_of[id(p)]] = master.float()
    if shape.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.float() for k, v in out.items()}


def consolidated_state_dict(ckpt_dir: Path, tag: str, shape: ModelShape) -> dict:
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise DrScaleError(f"{tag_dir}: checkpoint not found")
    if list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):  # ZeRO-1, 2 and 3 shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        except Exception as e:  # noqa: BLE001 - any failure here is a damaged checkpoint
            raise DrScaleError(f"{tag_dir}: cannot consolidate the ZeRO shards "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
        return {k: v.float() for k, v in state.items()}
    return _zero0_state(tag_dir, shape)
