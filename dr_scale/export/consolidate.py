"""One full fp32 state dict from a DeepSpeed checkpoint of any ZeRO stage, tensor-parallel
layout or pipeline stages.

Tensor-parallel checkpoints hold one set of files per tensor rank (`mp_rank_NN`): each rank's
slices are consolidated on their own by the ZeRO path below, then joined along the one dimension
where a slice is smaller than the model's parameter (column-parallel rows, row-parallel columns,
vocabulary rows of a split LM head); parameters of full size were replicated. Pipeline
checkpoints hold one file per layer and tensor rank (`layer_NN-model_MM`), named by the
PipelineModule's layer index: they are mapped back to the model's names (embedding, blocks, final
norm, untied head). They carry the weights the stages trained with (16-bit under a bf16 config);
their fp32 masters sit in per-stage optimizer shards that are not read here.
"""
import json
import re
import tempfile
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError
from dr_scale.models import build_model
from dr_scale.models.build import ModelShape
from dr_scale.train.checkpoint import load_ema_state, saved_topology


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
    fp32_groups, in the order of train.engine.param_groups (matrices, then vectors)."""
    from dr_scale.train.engine import param_groups

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
    if list(tag_dir.glob("layer_*-model_*-model_states.pt")):
        return _pipeline_state(tag_dir, shape)
    tensor = saved_topology(tag_dir).tensor
    if tensor > 1:  # DeepSpeed names each tensor rank's files mp_rank_00, mp_rank_01, ...
        return _join_tensor_slices([_one_tensor_rank(tag_dir, f"{r:02d}", shape)
                                    for r in range(tensor)], shape, tag_dir)
    return _one_rank_state(ckpt_dir, tag, shape)


def ema_state_dict(tag_dir: Path, shape: ModelShape) -> dict:
    """The EMA weights the ema callback saved, joined over tensor ranks like the weights."""
    topo = saved_topology(tag_dir)
    slices = [load_ema_state(tag_dir, shape.tie_embeddings, r, topo) for r in range(topo.tensor)]
    return slices[0] if topo.tensor == 1 else _join_tensor_slices(slices, shape, tag_dir)


def _one_rank_state(ckpt_dir: Path, tag: str, shape: ModelShape) -> dict:
    tag_dir = ckpt_dir / tag
    if list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):  # ZeRO-1, 2 and 3 shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        except Exception as e:  # noqa: BLE001 - any failure here is a damaged checkpoint
            raise DrScaleError(f"{tag_dir}: cannot consolidate the ZeRO shards "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
        return {k: v.float() for k, v in state.items()}
    return _zero0_state(tag_dir, shape)


def _one_tensor_rank(tag_dir: Path, rank: str, shape: ModelShape) -> dict:
    """The consolidated slices of one tensor rank: its files, seen under rank 00's names (the
    ZeRO consolidation reads one tensor rank's layout) in a folder of links."""
    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / tag_dir.name
        view.mkdir()
        for f in tag_dir.glob(f"*mp_rank_{rank}_*.pt"):
            (view / f.name.replace(f"mp_rank_{rank}", "mp_rank_00")).symlink_to(f.resolve())
        return _one_rank_state(Path(tmp), tag_dir.name, shape)  # shapes come from the files


def _join_tensor_slices(slices: list, shape: ModelShape, tag_dir: Path) -> dict:
    full = {n: p.shape for n, p in build_model(shape, device="meta").state_dict().items()}
    if shape.tie_embeddings:  # the ZeRO consolidation names a tied weight once
        for s in slices:
            s.setdefault("lm_head.weight", s.get("model.embed_tokens.weight"))
    out = {}
    for name, want in full.items():
        parts = [s.get(name) for s in slices]
        if any(p is None for p in parts):
            raise DrScaleError(f"{tag_dir}: tensor rank files disagree on parameter {name}")
        if parts[0].shape == want:
            out[name] = parts[0]
            continue
        dims = [d for d in range(len(want)) if parts[0].shape[d] != want[d]]
        joined = torch.cat(parts, dim=dims[0]) if len(dims) == 1 else None
        if joined is None or joined.shape != want:
            raise DrScaleError(f"{tag_dir}: {name}: {len(parts)} slices of shape "
                               f"{tuple(parts[0].shape)} do not join into {tuple(want)}")
        out[name] = joined
    return out


def _pipeline_state(tag_dir: Path, shape: ModelShape) -> dict:
    """Layer files back to model names: 0 the embedding, 1..L the blocks, L+1 the final norm,
    L+2 an untied LM head (a tied head is the embedding)."""
    L = shape.num_layers
    slices = {}
    for f in sorted(tag_dir.glob("layer_*-model_*-model_states.pt")):
        layer, rank = map(int, re.match(r"layer_(\d+)-model_(\d+)", f.name).groups())
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            if layer == 0:
                name = "model.embed_tokens.weight"
            elif layer <= L:
                name = f"model.layers.{layer - 1}.{key.removeprefix('block.')}"
            elif layer == L + 1:
                name = f"model.norm.{key}"
            else:
                name = f"lm_head.{key}"
            slices.setdefault(rank, {})[name] = value.float()
    # one tensor rank joins to itself; the join also checks every name and shape
    return _join_tensor_slices([slices[r] for r in sorted(slices)], shape, tag_dir)
