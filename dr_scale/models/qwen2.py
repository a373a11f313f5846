"""Qwen2 decoder: the Llama layout with biases on the q, k and v projections (none on o_proj).

Parameter names follow Hugging Face's Qwen2ForCausalLM, so export and import are a copy. Sliding
window attention (HF `use_sliding_window`, off in the released checkpoints) is not supported and
is refused on import.
"""
from dr_scale.errors import DrScaleError
from dr_scale.models import llama
from dr_scale.models.spec import HFFormat, ModelSpec
from dr_scale.registry import MODEL_REGISTRY


class Qwen2ForCausalLM(llama.LlamaForCausalLM):
    qkv_bias = True


def hf_config(shape, eod_id: int) -> dict:
    cfg = llama.hf_config(shape, eod_id, architecture="Qwen2ForCausalLM", model_type="qwen2")
    for llama_only in ("attention_bias", "mlp_bias"):
        del cfg[llama_only]
    cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_layers)
    return cfg


def shape_from_hf(config: dict, source: str) -> dict:
    if config.get("use_sliding_window"):
        raise DrScaleError(f"{source}: use_sliding_window=true is not supported (full causal "
                           "attention only); set it to false if the window covers the context")
    return llama.decoder_fields(config, source, "qwen2")


_QWEN2 = dict(arch="qwen2", norm_eps=1e-6, rope_theta=1000000.0)

SPEC = MODEL_REGISTRY.register("qwen2", ModelSpec(
    arch="qwen2", module=Qwen2ForCausalLM, gated_mlp=True, rotary=True,
    # The biases sit on column-parallel projections: AutoTP splits them with their weights.
    tp_plan=llama.TP_PLAN,
    sequence_parallel=("model.embed_tokens", "lm_head"), pipeline=llama.PIPELINE,
    hf=HFFormat("Qwen2ForCausalLM", "qwen2", hf_config, shape_from_hf),
    presets={
        # Tests and quick runs: untied head, 2 KV heads as in the released models.
        "qwen2_tiny": dict(_QWEN2, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                           ffn_hidden_size=704, max_seq_length=1024, vocab_size=4096,
                           tie_embeddings=False),
        # Qwen2-0.5B / Qwen2.5-0.5B shape (494M parameters with the 151,936 vocabulary).
        "qwen2_0_5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_heads=14,
                           num_kv_heads=2, ffn_hidden_size=4864, max_seq_length=32768,
                           vocab_size=151936, tie_embeddings=True),
    }))
