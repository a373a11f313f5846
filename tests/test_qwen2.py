"""The Qwen2 family (one model file): its shape against transformers' Qwen2, tensor, sequence and
pipeline parallelism against one rank (the q/k/v biases split with their columns), and export and
import through transformers' Qwen2ForCausalLM with equal logits."""
import json

import pytest
import torch

from dr_scale.errors import DrScaleError
from tests.test_export import export
from tests.conftest import module_folder
from tests.test_parallel import assert_same, assert_same_weights, run

QWEN = "model.preset=qwen2_tiny"


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory, cache_dir):
    return run(module_folder(request, tmp_path_factory, "qwen_ref"), cache_dir, "ref", 1, 1, 4, QWEN)


def test_preset_has_the_released_shape():
    """qwen2_0_5b builds (on meta) the parameter names and shapes transformers builds for
    Qwen2-0.5B's config, so a released checkpoint imports tensor for tensor."""
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM as HFQwen2

    from dr_scale.config.schema import ModelConfig
    from dr_scale.models import build_model, resolve_shape
    from dr_scale.models.build import count_parameters

    shape = resolve_shape(ModelConfig(preset="qwen2_0_5b"))
    ours = build_model(shape, device="meta")
    with torch.device("meta"):
        theirs = HFQwen2(Qwen2Config(
            hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True))
    want = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert count_parameters(ours) == 494_032_768  # Qwen2-0.5B, head tied to the embedding
    assert ours.model.layers[0].self_attn.q_proj.bias is not None
    assert ours.model.layers[0].self_attn.o_proj.bias is None


def test_reference_learns(reference):
    assert reference[0][-1] < reference[0][0] - 0.3


def test_tensor_and_sequence_parallel_equal_one_rank(reference, tmp_path, cache_dir):
    """TP 2 + SP + selective recomputation: the q/k/v biases are split with their columns (a
    bias left whole would not even load; one split in the wrong order moves its heads)."""
    got = run(tmp_path, cache_dir, "tp2_sp", 1, 2, 4, QWEN, "parallel.tensor_parallel=2",
              "parallel.sequence_parallel=true", "parallel.activation_checkpointing=selective")
    assert_same(got, reference)
    assert "model.layers.0.self_attn.k_proj.bias" in got[4]


def test_pipeline_equals_one_rank(reference, tmp_path, cache_dir):
    losses, _, _, ds_norm, weights, _, _ = run(tmp_path, cache_dir, "dp2_pp2", 1, 4, 1, QWEN,
                                               "parallel.pipeline_parallel=2", monitor=False)
    assert losses == pytest.approx(reference[0], rel=1e-5)
    assert ds_norm == pytest.approx(reference[3], rel=1e-5)
    assert_same_weights(weights, reference[4])


def test_export_and_import_through_transformers(reference, tmp_path):
    """dr-scale export writes a folder transformers loads as Qwen2ForCausalLM with our logits;
    model.init_from reads it back into our model, tensor for tensor."""
    from transformers import Qwen2ForCausalLM as HFQwen2

    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.export.hf import apply_init_from, load_into
    from dr_scale.models import build_model

    run_dir, out = reference[6], tmp_path / "hf"
    proc = export(run_dir, out)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    hf = HFQwen2.from_pretrained(str(out), dtype=torch.float32).eval()
    shape = run_shape(run_dir)
    ours = build_model(shape)
    ours.load_state_dict(consolidated_state_dict(run_dir / "checkpoints", "step_00000005", shape))
    ids = torch.randint(0, shape.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-4  # fp32 both

    cfg = _init_cfg(out)
    state = apply_init_from(cfg)
    assert (cfg.model.arch, cfg.model.num_kv_heads, cfg.model.tie_embeddings) == \
        ("qwen2", 2, False)
    assert cfg.model.rope_theta == 1e6 and cfg.model.norm_eps == 1e-6
    imported = build_model(shape)
    load_into(imported, state, str(out))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name

    config["use_sliding_window"] = True
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrScaleError, match="use_sliding_window=true is not supported"):
        apply_init_from(_init_cfg(out))


def _init_cfg(folder):
    from dr_scale.config.schema import RunConfig

    cfg = RunConfig()
    cfg.model.init_from = str(folder)
    return cfg
