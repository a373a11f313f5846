"""The fp32 weights of a DeepSpeed checkpoint of any ZeRO stage, tensor-parallel layout or
pipeline stages, as a source read a tensor at a time (export/checkpoint_source.py) or as one
state dict.

Tensor-parallel checkpoints hold one set of files per tensor rank (`mp_rank_NN`): each rank's
slices are read on their own by the ZeRO path, then joined along the one dimension where a slice
is smaller than the model's parameter (column-parallel rows, row-parallel columns, vocabulary
rows of a split LM head); parameters of full size were replicated. Pipeline checkpoints hold one
file per layer and tensor rank (`layer_NN-model_MM`), named by the PipelineModule's layer index:
they are mapped back to the model's names (embedding, blocks, final norm, untied head). They
carry the weights the stages trained with (16-bit under a bf16 config); their fp32 masters sit in
per-stage optimizer shards that are not read here.
"""
import json
import re
import tempfile
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError
from dr_scale.export.checkpoint_source import (PipelineSource, Source, TensorJoin,
                                               UniversalSource, WholeSource, Zero3Source)
from dr_scale.models import build_model
from dr_scale.models.build import ModelShape, spec_of
from dr_scale.callbacks.ema import load_ema_state
from dr_scale.checkpoint.layout import saved_buffers, saved_topology


def run_shape(run_dir: Path) -> ModelShape:
    info_path = run_dir / "run.json"
    if not info_path.is_file():
        raise DrScaleError(f"{info_path}: not found; expected a run folder made by "
                           "launchers/pretrain.py")
    try:
        return ModelShape(**json.loads(info_path.read_text())["model"]["shape"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DrScaleError(f"{info_path}: unreadable model shape ({type(e).__name__})") from None


def _saved_groups(model, optimizer_state: dict) -> list:
    """parallel.optimizer_groups.param_groups as the run built them: Muon's (parallel/muon.py)
    where the saved groups say use_muon."""
    from dr_scale.parallel import muon
    from dr_scale.parallel.optimizer_groups import param_groups

    saved = (optimizer_state.get("optimizer_state_dict") or {}).get("param_groups", [])
    if not any(g.get("use_muon") for g in saved):
        return param_groups(model, 0.0)
    muon.tag(model)
    settings = {"lr": 0.0, "muon_lr": 0.0, "momentum": 0.0, "betas": (0.0, 0.0), "eps": 0.0}
    return param_groups(model, 0.0, muon=settings)  # the order only: the values are not used


def _zero0_state(tag_dir: Path, shape: ModelShape) -> dict:
    """ZeRO-0 keeps one file; with bf16/fp16 its fp32 master copies sit in the optimizer's
    fp32_groups, in the order of parallel.optimizer_groups.param_groups (matrices, then vectors)."""
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
    for group, masters in zip(_saved_groups(model, sd["optimizer"]), groups):
        for p, master in zip(group["params"], masters):
            out[name_of[id(p)]] = master.float()
    out = spec_of(shape.arch).tie_head(out, shape.tie_embeddings)
    return {k: v.float() for k, v in out.items()}


def checkpoint_source(ckpt_dir: Path, tag: str, shape: ModelShape) -> Source:
    """The checkpoint's fp32 weights a tensor at a time (export/checkpoint_source.py), named and
    shaped as the model's, in its order; a tied head appears once, as the embedding."""
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise DrScaleError(f"{tag_dir}: checkpoint not found")
    full = _model_shapes(shape)
    layer_files = list(tag_dir.glob("layer_*-model_*-model_states.pt"))
    # expert parallel: per-expert files (ZeRO-1/2), or ZeRO-3's partitions over expert-data
    # groups, which DeepSpeed's zero_to_fp32 refuses and its universal conversion reads
    if list(tag_dir.glob("layer_*_expert_*_model_states.pt")) or \
            saved_topology(tag_dir).expert > 1:
        ranks = _expert_parallel_sources(tag_dir, full)
    elif layer_files:
        by_rank = {}
        for f in layer_files:
            by_rank.setdefault(int(re.match(r"layer_\d+-model_(\d+)", f.name).group(1)),
                               []).append(f)
        ranks = [PipelineSource(by_rank[r], shape.num_layers, spec_of(shape.arch).pipeline) for r in sorted(by_rank)]
    else:
        tensor = saved_topology(tag_dir).tensor
        # DeepSpeed names each tensor rank's files mp_rank_00, mp_rank_01, ...
        ranks = ([_one_tensor_rank(tag_dir, f"{r:02d}", shape) for r in range(tensor)]
                 if tensor > 1 else [_one_rank_source(ckpt_dir, tag, shape)])
    source = TensorJoin(ranks, full, tag_dir)
    missing = sorted(set(full) - set(dict(source.entries)))
    if missing:
        raise DrScaleError(f"{tag_dir}: no weights for {missing[0]} (and {len(missing) - 1} "
                           "more): truncated or foreign checkpoint")
    return source


def consolidated_state_dict(ckpt_dir: Path, tag: str, shape: ModelShape) -> dict:
    """One full fp32 state dict (load_state_dict takes it; a tied head under both names)."""
    state = checkpoint_source(ckpt_dir, tag, shape).state_dict()
    return spec_of(shape.arch).tie_head(state, shape.tie_embeddings)


def ema_source(tag_dir: Path, shape: ModelShape) -> Source:
    """The EMA weights the ema callback saved (whole in memory: they are saved as per-rank
    slices of every tensor), joined over tensor ranks like the weights."""
    topo = saved_topology(tag_dir)
    ranks = [WholeSource(load_ema_state(tag_dir, shape, r, topo))
             for r in range(topo.tensor)]
    return TensorJoin(ranks, _model_shapes(shape), tag_dir)


def ema_state_dict(tag_dir: Path, shape: ModelShape) -> dict:
    state = ema_source(tag_dir, shape).state_dict()
    return spec_of(shape.arch).tie_head(state, shape.tie_embeddings)


def _model_shapes(shape: ModelShape) -> dict:
    """Name -> shape of the model's tensors, in its order; a tied head left out."""
    full = {n: tuple(p.shape) for n, p in build_model(shape, device="meta").state_dict().items()}
    if shape.tie_embeddings:
        full.pop("lm_head.weight", None)
    return full


def _one_rank_source(ckpt_dir: Path, tag: str, shape: ModelShape) -> Source:
    tag_dir = ckpt_dir / tag
    if list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):  # ZeRO-1, 2 and 3 shards
        def damaged(e):
            return DrScaleError(f"{tag_dir}: cannot consolidate the ZeRO shards "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return Zero3Source(ckpt_dir, tag, damaged)
    return WholeSource(_zero0_state(tag_dir, shape))


def _expert_parallel_sources(tag_dir: Path, full: dict) -> list:
    """An expert-parallel checkpoint: through DeepSpeed's universal form (its fp32 masters), in
    a temporary folder beside the checkpoint (the same file system: as large as its weights and
    moments, gone with the source). Under tensor parallelism, which DeepSpeed 0.19.8's
    conversion refuses with experts, each tensor rank's weights as the run held them (16-bit
    under a bf16 config, as a pipeline's are), its experts from the per-expert files."""
    from dr_scale.checkpoint.reshard import default_workers, ds_to_universal

    tensor = saved_topology(tag_dir).tensor
    if tensor == 1:
        keep = tempfile.TemporaryDirectory(prefix=".export-", dir=tag_dir.parent)
        folder = Path(keep.name) / "universal"
        ds_to_universal(tag_dir, folder, default_workers(tag_dir), show_progress=True)
        return [UniversalSource(folder, full, keep, saved_buffers(tag_dir))]
    experts = {}  # name -> {expert: tensor}, the experts replicated over the tensor group
    for f in tag_dir.glob("layer_*_expert_*_mp_rank_00_model_states.pt"):
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            name, expert = key.rsplit(".", 1)
            experts.setdefault(name, {})[int(expert)] = value
    stacked = {n: torch.stack([e[i] for i in sorted(e)]) for n, e in experts.items()}
    ranks = []
    for r in range(tensor):
        states = torch.load(tag_dir / f"mp_rank_{r:02d}_model_states.pt", map_location="cpu",
                            weights_only=False)  # DeepSpeed's own pickle
        ranks.append(WholeSource({**states["module"], **stacked}, list(full)))
    return ranks


def _one_tensor_rank(tag_dir: Path, rank: str, shape: ModelShape) -> Source:
    """The source of one tensor rank: its files, seen under rank 00's names (the ZeRO
    consolidation reads one tensor rank's layout) in a folder of links that lives as long as
    the source."""
    tmp = tempfile.TemporaryDirectory()
    view = Path(tmp.name) / tag_dir.name
    view.mkdir()
    for f in tag_dir.glob(f"*mp_rank_{rank}_*.pt"):
        (view / f.name.replace(f"mp_rank_{rank}", "mp_rank_00")).symlink_to(f.resolve())
    source = _one_rank_source(Path(tmp.name), tag_dir.name, shape)  # shapes from the files
    source.links = tmp
    return source
