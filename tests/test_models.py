"""Decoders: shapes, presets, parameter counts, init, attention implementations, FLOPs."""
import math

import pytest
import torch

from dr_scale.config import load_config
from dr_scale.errors import DrScaleError
from dr_scale.models import build_model, resolve_shape
from dr_scale.models.build import count_parameters, spec_of


def shape_of(*overrides, vocab=None):
    return resolve_shape(load_config(overrides=list(overrides)).model, vocab)


# Published sizes of the architectures these presets copy.
@pytest.mark.parametrize("preset, params", [
    ("llama_7b", 6_738_415_616),      # Llama-2-7B
    ("llama_70b", 68_976_648_192),    # Llama-2-70B
    ("llama_1b", 1_235_814_400),      # Llama-3.2-1B
    ("gpt2_124m", 124_439_808),       # GPT-2 small (lm_head tied)
])
def test_preset_parameter_counts_on_meta(preset, params):
    model = build_model(shape_of(f"model.preset={preset}"), device="meta")
    assert count_parameters(model) == params
    assert all(p.device.type == "meta" for p in model.parameters())


def test_vocab_from_tokenizer_is_padded():
    assert shape_of(vocab=4000).vocab_size == 4032
    assert shape_of("model.vocab_size=5000", vocab=4000).vocab_size == 5000
    with pytest.raises(DrScaleError, match=r"model\.vocab_size=100 is smaller than the tokenizer's vocabulary \(4000\)"):
        shape_of("model.vocab_size=100", vocab=4000)


@pytest.mark.parametrize("overrides, pattern", [
    (["model.preset=nano"], r"unknown preset 'nano'; known: .*tiny"),
    (["model.num_heads=7"], r"hidden_size=256 is not divisible by model\.num_heads=7"),
    (["model.num_kv_heads=3"], r"num_heads=8 is not a multiple of model\.num_kv_heads=3"),
    (["model.attention=flashy"], r"unknown attention implementation 'flashy'; known: eager, sdpa"),
])
def test_bad_model_config(overrides, pattern):
    with pytest.raises(DrScaleError, match=pattern):
        shape_of(*overrides)


@pytest.mark.parametrize("preset", ["tiny", "gpt2_tiny"])
def test_forward_shapes_and_initial_loss_near_uniform(preset):
    torch.manual_seed(0)
    shape = shape_of(f"model.preset={preset}", vocab=4096)
    model = build_model(shape)
    ids = torch.randint(0, 4096, (2, 33))
    logits = model(ids[:, :-1])
    assert logits.shape == (2, 32, shape.vocab_size)
    loss = model(ids[:, :-1], ids[:, 1:])
    assert abs(loss.item() - math.log(shape.vocab_size)) < 0.5  # small init: near-uniform logits


def test_tied_and_untied_embeddings():
    tied = build_model(shape_of(vocab=512))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = build_model(shape_of("model.tie_embeddings=false", vocab=512))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert count_parameters(untied) - count_parameters(tied) == 512 * 256


def test_output_projections_get_scaled_init():
    torch.manual_seed(0)
    model = build_model(shape_of("model.num_layers=8", "model.hidden_size=512", vocab=512))
    q_std = model.model.layers[0].self_attn.q_proj.weight.std().item()
    o_std = model.model.layers[0].self_attn.o_proj.weight.std().item()
    assert q_std == pytest.approx(0.02, rel=0.05)
    assert o_std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("kv_heads", [8, 4, 1])
def test_sdpa_equals_eager_with_grouped_query_heads(kv_heads):
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 40))
    out = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(1)
        model = build_model(shape_of(f"model.attention={impl}", f"model.num_kv_heads={kv_heads}",
                                     vocab=512))
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out[impl] = (loss.item(), model.model.layers[0].self_attn.k_proj.weight.grad.clone())
    assert out["sdpa"][0] == pytest.approx(out["eager"][0], abs=1e-5)
    torch.testing.assert_close(out["sdpa"][1], out["eager"][1], atol=1e-6, rtol=1e-4)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model(shape_of(vocab=512)).eval()
    ids = torch.randint(0, 512, (1, 20))
    changed = ids.clone()
    changed[0, 15] = (ids[0, 15] + 1) % 512
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[0, :15], b[0, :15])
    assert (a[0, 15:] - b[0, 15:]).abs().max() > 1e-4


def test_rotary_matches_a_direct_complex_rotation():
    from dr_scale.kernels import reference

    torch.manual_seed(0)
    x = torch.randn(1, 2, 7, 8)
    cos, sin = reference.rotary_tables(7, 8, 10000.0)
    got = reference.apply_rotary(x, cos, sin)
    # Pair (i, i + 4) as a complex number rotated by angle pos * theta^(-2i/8).
    z = torch.complex(x[..., :4], x[..., 4:])
    ang = torch.arange(7)[:, None] * (10000.0 ** (-torch.arange(0, 8, 2) / 8))[None, :]
    rz = z * torch.polar(torch.ones_like(ang), ang)
    torch.testing.assert_close(got, torch.cat([rz.real, rz.imag], dim=-1), atol=1e-5, rtol=1e-5)


def test_flops_per_token_formula():
    s = shape_of(vocab=4096)
    d, L, f, V, kv = 256, 4, 704, 4096, 4 * 32
    expect = 6 * (L * (2 * d * d + 2 * d * kv + 3 * d * f) + d * V) + 12 * L * d * 256
    assert spec_of(s.arch).flops_per_token(s, 256) == expect
    # 6N rule: for a large model the matmul term is ~6 x parameters.
    big = shape_of("model.preset=llama_7b")
    n = count_parameters(build_model(big, device="meta"))
    assert spec_of(big.arch).flops_per_token(big, 0) == pytest.approx(6 * n, rel=0.02)


def test_tiny_model_learns_a_repeated_batch():
    torch.manual_seed(0)
    model = build_model(shape_of(vocab=256))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 33))
    first = None
    for _ in range(30):
        loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or loss.item()
    assert loss.item() < 0.5 * first
