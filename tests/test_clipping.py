"""Per-layer clipping under ZeRO: whole-parameter norms (not shard norms), the same clipped
gradients under ZeRO-0, 1, 2 and 3 on 2 ranks, equal to clipping an unpartitioned model's
gradients, and consumed by DeepSpeed's optimizer step."""
import os

import pytest
import torch

from dr_scale.callbacks.per_layer_clip import DEFAULT_EXEMPT, PerLayerClip, clip_factors, exempt_mask
from dr_scale.config import load_config
from dr_scale.parallel.optimizer_groups import param_groups
from dr_scale.models import build_model, resolve_shape
from tests.conftest import ROOT, free_port, run_group, module_folder

MAX_NORM = 0.05  # below most of the tiny model's gradient norms at init, above some


@pytest.fixture(scope="module")
def clipped(request, tmp_path_factory):
    out = module_folder(request, tmp_path_factory, "clip") / "clipped.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code, stdout, stderr = run_group(
        ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
         str(ROOT / "tests" / "scripts" / "per_layer_clip.py"), str(out), str(MAX_NORM)],
        env, 300)
    assert code == 0, (stdout + stderr)[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference(clipped):
    """The unpartitioned model's averaged gradients over both ranks' batches, clipped per layer."""
    shape = resolve_shape(load_config(overrides=["model.preset=tiny"]).model, 256)
    model = build_model(shape)
    model.load_state_dict(clipped["initial"])
    tokens = clipped["tokens"]
    loss = sum(model(tokens[r][:, :-1], tokens[r][:, 1:]) for r in range(2)) / 2
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    norms = torch.stack([p.grad.norm() for p in model.parameters()])
    exempt = torch.tensor(exempt_mask(names, DEFAULT_EXEMPT))
    factors = clip_factors(norms, MAX_NORM, exempt)
    grads = {n: p.grad * f for (n, p), f in zip(model.named_parameters(), factors)}
    for (n, p) in model.named_parameters():
        p.grad = grads[n]
    model.load_state_dict(clipped["initial"])
    torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, eps=1.0).step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"names": names, "norms": norms, "factors": factors, "grads": grads,
            "stepped": stepped, "exempt": exempt}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_reference_clips_some_but_not_all(reference):
    clipped_count = int((reference["factors"] < 1).sum())
    assert 0 < clipped_count < len(reference["names"]) - int(reference["exempt"].sum())
    assert reference["exempt"].sum() >= 5  # every norm weight of the tiny model


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-4), ("bf16", 3e-2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipped_gradients_equal_reference(clipped, reference, precision, stage, tol):
    got = clipped[f"{precision}_zero{stage}"]
    # Whole-parameter norms on every rank, not shard norms (which would be about 1/sqrt(2) of them).
    assert torch.allclose(got["norms"], reference["norms"], rtol=tol / 10 if precision == "fp32"
                          else 5e-3)
    assert torch.equal(got["factors"] < 1, reference["factors"] < 1)
    for name in reference["names"]:
        assert rel(got["grads"][name], reference["grads"][name]) < tol, name


def test_zero3_equals_zero0(clipped):
    z0, z3 = clipped["fp32_zero0"], clipped["fp32_zero3"]
    for name, g in z0["grads"].items():
        assert rel(z3["grads"][name], g) < 1e-5, name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_consumed_the_clipped_gradients(clipped, reference, stage):
    got = clipped[f"fp32_zero{stage}"]["stepped"]
    for name, want in reference["stepped"].items():
        update = (want - clipped["initial"][name]).abs().max()
        assert (got[name] - want).abs().max() < 1e-3 * update, name


def test_exempt_patterns_cover_norms_and_biases():
    names = ["model.layers.0.input_layernorm.weight", "model.norm.weight",
             "model.layers.0.mlp.down_proj.weight", "transformer.h.0.ln_1.weight",
             "transformer.h.0.attn.c_attn.bias", "transformer.ln_f.weight", "lm_head.weight"]
    assert exempt_mask(names, DEFAULT_EXEMPT) == [True, True, False, True, True, True, False]
    assert exempt_mask(names, []) == [False] * len(names)


def test_bad_options_are_one_line():
    from dr_scale.errors import DrScaleError
    from dr_scale.callbacks.build import build_callbacks

    with pytest.raises(DrScaleError, match=r"callbacks.per_layer_clip.max_norm: expected a "
                                           r"value >= 1e-12, got -1"):
        build_callbacks({"per_layer_clip": {"enabled": True, "max_norm": -1}})
    with pytest.raises(DrScaleError, match="callbacks.per_layer_clip.exempt: expected a list"):
        build_callbacks({"per_layer_clip": {"enabled": True, "exempt": "*bias"}})
    assert isinstance(build_callbacks({"per_layer_clip": {"enabled": True}})[0], PerLayerClip)
