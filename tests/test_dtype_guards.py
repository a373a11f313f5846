"""Where torch or DeepSpeed could change a tensor's dtype or device behind the model's back, the
rotary tables and initial values stay what a plain fp32 build makes: module casts, a default
dtype set elsewhere, autocast, and DeepSpeed's buffer_dtype (refused, one line). zero.Init
itself is covered by tests/test_build_equivalence.py."""
import pytest
import torch

from dr_scale.config import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.errors import DrScaleError
from dr_scale.kernels import reference
from dr_scale.models import build_model, resolve_shape

LONG = ["model.max_seq_length=8192", "model.hidden_size=64", "model.num_heads=4",
        "model.num_kv_heads=2", "model.num_layers=1", "model.ffn_hidden_size=128"]


def shape(*overrides):
    return resolve_shape(load_config(None, [*LONG, *overrides]).model, 256)


def exact_tables(s):
    return reference.rotary_tables(s.max_seq_length, s.head_dim, s.rope_theta,
                                   scale_frequencies=s.rope_scaling)


def test_module_casts_leave_the_rotary_tables_fp32_and_exact():
    s = shape()
    cos, sin = exact_tables(s)
    model = build_model(s)
    for cast in (lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.to(torch.float64),
                 lambda m: m.to("cpu", torch.bfloat16)):
        cast(model)
        rotary = model.model.rotary
        assert rotary.cos.dtype == rotary.sin.dtype == torch.float32
        assert torch.equal(rotary.cos, cos) and torch.equal(rotary.sin, sin)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # the weights did follow


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_a_default_dtype_set_elsewhere_changes_neither_tables_nor_initial_values(default):
    s = shape("model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, "
              "high_freq_factor: 4.0, original_max_position_embeddings: 1024}")
    torch.manual_seed(3)
    plain = build_model(s)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        torch.manual_seed(3)
        other = build_model(s)
    finally:
        torch.set_default_dtype(saved)
    for name, buf in plain.named_buffers():
        assert torch.equal(dict(other.named_buffers())[name], buf), name
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        assert q.dtype == default, name  # torch's layers follow the default dtype ...
        assert torch.equal(q, p.to(default)), name  # ... the values are the fp32 draws


def test_autocast_leaves_tables_and_rotation_in_fp32():
    s = shape()
    model = build_model(s).eval()
    tokens = torch.randint(0, 256, (1, 4096), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
        cos, sin = model.model.rotary(4096)
        q = torch.randn(1, 4, 4096, s.head_dim, generator=torch.Generator().manual_seed(1))
        inside = reference.apply_rotary(q, cos, sin)
    assert cos.dtype == torch.float32
    assert torch.equal(cos, exact_tables(s)[0][:4096])
    assert torch.equal(inside, reference.apply_rotary(q, cos, sin))


@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_deepspeed_buffer_dtype_is_refused_in_one_line(value):
    cfg = load_config(None, [])
    ds = {"train_micro_batch_size_per_gpu": "auto", "data_types": {"buffer_dtype": value}}
    with pytest.raises(DrScaleError) as e:
        dsc.fill(ds, cfg, 1, source="my.json")
    assert str(e.value).startswith(f"my.json: data_types.buffer_dtype='{value}'")
    assert "\n" not in str(e.value)
    dsc.fill(dict(ds, data_types={"buffer_dtype": "fp32"}), cfg, 1, source="my.json")
