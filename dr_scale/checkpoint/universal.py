"""Between ZeRO families in DeepSpeed's universal checkpoint format.

ds_to_universal writes per-parameter fp32 / exp_avg / exp_avg_sq files in two dialects: from
ZeRO-3 a flat tensor per file and no step count (under tensor parallelism, the slices joined:
{"param": shaped tensor, "cat_dim": ...}); from ZeRO-1/2 {"param": shaped tensor, "cat_dim": 0}
plus step.pt. ZeRO-1/2's loader reads only the dict; ZeRO-3's reads either, and cuts a dict's
tensor to the rank's tensor-parallel slice by the AutoTP metadata on the parameter (a flat
tensor it would not cut). So resuming ZeRO-3 at ZeRO-1/2 (or back) means rewriting flat tensors
as dicts, adding the step count and global optimizer keys the other loader asks for, and
providing the model-states files under the names it opens. The values themselves are not
touched.
"""
import re
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
    for tensor_rank in model_states_ranks(udir, "zero_pp_rank_0_mp_rank_*_model_states.pt"):
        shutil.copyfile(udir / f"zero_pp_rank_0_mp_rank_{tensor_rank}_model_states.pt",
                        udir / f"mp_rank_{tensor_rank}_model_states.pt")


def zero12_to_zero3(udir: Path, world_size: int):
    ms = _load(udir / "mp_rank_00_model_states.pt")
    step = None
    for name in _param_shapes(ms):
        path = udir / "zero" / name / "step.pt"
        if path.is_file():
            step = _load(path)
            path.unlink()
    opt = _load(udir / "zero" / "optimizer_state.pt")
    opt.setdefault("optimizer_state_dict", {"state": {0: {"step": step}},
                                            "param_groups": opt.get("param_groups", [])})
    torch.save(opt, udir / "zero" / "optimizer_state.pt")
    for tensor_rank in model_states_ranks(udir, "mp_rank_*_model_states.pt"):
        zero3_model_states(udir, udir / f"mp_rank_{tensor_rank}_model_states.pt", tensor_rank,
                           world_size)


def model_states_ranks(udir: Path, pattern: str) -> list:
    """The tensor ranks ("00", "01", ...) of the model-states files matching `pattern`: the
    universal load reads the source's, whatever the target's tensor-parallel size."""
    return sorted(f.name.split("mp_rank_")[1][:2] for f in Path(udir).glob(pattern))


def zero3_model_states(udir: Path, source: Path, tensor_rank: str, world_size: int):
    """ZeRO-3 opens a model-states file under its data-parallel rank's name as well."""
    for rank in range(world_size):
        target = udir / f"zero_pp_rank_{rank}_mp_rank_{tensor_rank}_model_states.pt"
        if target != source:
            shutil.copyfile(source, target)


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


# Between a pipeline's parameter names and the model's. DeepSpeed's PipelineModule names a
# parameter by its layer's index ("3.block.mlp.up_proj.weight", "5.weight") and a tied layer's
# under its key ("tied_modules.embed.weight": parallel/pipeline.py ties the embedding as
# "embed"); the indices do not depend on the number of stages, so one renaming serves every
# pipeline size. The family's PipelineLayout (models/spec.py) maps layers to model names.
TIED_EMBEDDING = "tied_modules.embed."


def _layout(signature: dict):
    from dr_scale.models.build import spec_of

    if not signature:
        raise DrScaleError("the checkpoint's trainer state names no model (written by an older "
                           "dr_scale): its pipeline's parameters cannot be named")
    layout = spec_of(signature["arch"]).pipeline
    if layout is None:
        raise DrScaleError(f"model family {signature['arch']} has no pipeline layout")
    return layout, int(signature["num_layers"]), bool(signature["tie_embeddings"])


def from_pipeline_names(udir: Path, signature: dict):
    """zero/<pipeline name> -> zero/<model name>; a tied embedding also under the LM head's name
    (a module with the head tied names the one parameter both ways)."""
    from dr_scale.models.build import spec_of

    layout, num_layers, tied = _layout(signature)
    zero = Path(udir) / "zero"
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        if folder.name.startswith(TIED_EMBEDDING):
            layer, key = 0, folder.name[len(TIED_EMBEDDING):]
        else:
            index, key = folder.name.split(".", 1)
            layer = int(index)
        folder.rename(zero / layout.model_name(layer, key, num_layers))
    embedding = spec_of(signature["arch"]).embedding_weight
    if tied and (zero / embedding).is_dir():
        shutil.copytree(zero / embedding, zero / "lm_head.weight")


def to_pipeline_names(udir: Path, signature: dict):
    """zero/<model name> -> zero/<pipeline name>, and the layer files a PipelineModule loads its
    weights from (`layer_NN-model_00-model_states.pt`: one tensor rank, as pipelines convert
    without tensor parallelism), written a layer at a time from the fp32 values."""
    layout, num_layers, tied = _layout(signature)
    zero = Path(udir) / "zero"
    by_layer: dict = {}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        if tied and folder.name == "lm_head.weight":
            shutil.rmtree(folder)  # the embedding's, under the tied layer's name
            continue
        layer, key = layout.pipeline_name(folder.name, num_layers)
        name = f"{TIED_EMBEDDING}{key}" if tied and layer == 0 else f"{layer}.{key}"
        folder.rename(zero / name)
        by_layer.setdefault(layer, []).append((key, zero / name / "fp32.pt"))
    for layer, entries in sorted(by_layer.items()):
        state = {key: _load(path)["param"] for key, path in entries}
        torch.save(state, Path(udir) / f"layer_{layer:02d}-model_00-model_states.pt")


# Expert parallelism keeps the experts' parameters in optimizer groups of their own (DeepSpeed's
# `moe` groups, appended after the others: parallel/expert.py); the universal form carries the
# saved run's groups (their hyperparameters, and the LR scheduler's one entry per group).
EXPERT_PARAMETER = re.compile(r"\.mlp\.experts\.w[123]$")


def to_expert_groups(udir: Path, expert: int):
    """Re-lay a ZeRO-1/2 universal form's optimizer groups for a run with `expert`-way expert
    parallelism (1: none): the saved `moe` groups dropped, or one added with the weight-decayed
    group's hyperparameters (the experts are matrices); the experts' files marked as DeepSpeed's
    loader cuts them to a rank's experts. The values are not touched."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS

    opt_path = udir / "zero" / "optimizer_state.pt"
    opt = _load(opt_path)
    groups = opt["param_groups"]
    order = [i for i, g in enumerate(groups) if not g.get("moe")]
    if expert > 1:
        order.append(next(i for i in order if groups[i].get("weight_decay")))
    opt["param_groups"] = [dict(groups[i]) for i in order]
    if expert > 1:
        opt["param_groups"][-1].update(name=f"ep_size_{expert}", moe=True)
    for key in ("group_paddings", "partition_count", "param_alignment_paddings"):
        if isinstance(opt.get(key), list) and len(opt[key]) == len(groups):
            opt[key] = [opt[key][i] for i in order]
    torch.save(opt, opt_path)
    for states in Path(udir).glob("mp_rank_*_model_states.pt"):
        ms = _load(states)
        scheduler = ms.get("lr_scheduler") or {}
        for key, value in scheduler.items():
            if isinstance(value, list) and len(value) == len(groups):
                scheduler[key] = [value[i] for i in order]
        torch.save(ms, states)
    if expert > 1:
        for folder in (udir / "zero").iterdir():
            if EXPERT_PARAMETER.search(folder.name):
                for f in folder.glob("*.pt"):
                    t = _load(f)
                    if isinstance(t, dict) and "param" in t:
                        t.update({EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: t["param"].shape[0]})
                        torch.save(t, f)
