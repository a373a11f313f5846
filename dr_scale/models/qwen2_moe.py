"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the MoE decoder (models/mixtral.py) with biases on
the q, k and v projections, softmax routing (top k, renormalised or not: transformers'
norm_topk_prob), and one shared expert behind a sigmoid gate in every MoE block; dense blocks
where transformers' mlp_only_layers lists them (here the first `dense_layers`).

transformers' Qwen2MoeForCausalLM reads it (export and import, models/moe_hf.py); its
checkpoints name the shared expert `mlp.shared_expert` and its gate `mlp.shared_expert_gate`.
"""
import dataclasses

from dr_scale.errors import DrScaleError
from dr_scale.models import llama, moe_hf
from dr_scale.models.mixtral import MixtralForCausalLM
from dr_scale.models.spec import HFFormat, ModelSpec
from dr_scale.registry import MODEL_REGISTRY


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    qkv_bias = True


NAMES = moe_hf.Names(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")


def hf_config(shape, eod_id: int) -> dict:
    moe = shape.moe
    moe_hf.refuse_unless(shape, "Qwen2MoeForCausalLM", score="softmax", route_scale=1.0,
                         shared_experts=True, shared_gate=True, expert_bias=False)
    cfg = llama.hf_config(shape, eod_id, architecture="Qwen2MoeForCausalLM",
                          model_type="qwen2_moe")
    for llama_only in ("attention_bias", "mlp_bias"):
        del cfg[llama_only]
    cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
               moe_intermediate_size=moe.expert_width(shape.ffn_hidden_size),
               shared_expert_intermediate_size=moe.shared_width(shape.ffn_hidden_size),
               norm_topk_prob=moe.route_norm, decoder_sparse_step=1,
               mlp_only_layers=list(range(moe.dense_layers)), qkv_bias=True,
               router_aux_loss_coef=moe_hf.aux_coef_to_hf(shape), output_router_logits=False,
               use_sliding_window=False, sliding_window=None,
               max_window_layers=shape.num_layers)
    return cfg


def shape_from_hf(config: dict, source: str) -> dict:
    if config.get("use_sliding_window"):
        raise DrScaleError(f"{source}: use_sliding_window=true is not supported (full causal "
                           "attention only)")
    if config.get("qkv_bias") is False:
        raise DrScaleError(f"{source}: qkv_bias=false is not supported (the family has q, k "
                           "and v biases)")
    fields = llama.decoder_fields(config, source, "qwen2_moe")
    try:
        layers = fields["num_layers"]
        dense = sorted(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1)
        if dense != list(range(len(dense))) or step != 1:
            raise DrScaleError(f"{source}: mlp_only_layers={dense}, decoder_sparse_step={step}: "
                               "only the first blocks may be dense (mlp_only_layers 0..n-1, "
                               "decoder_sparse_step 1)")
        top_k = config["num_experts_per_tok"]
        fields["moe"] = dict(
            num_experts=config["num_experts"], top_k=top_k,
            expert_ffn=config["moe_intermediate_size"],
            shared_ffn=config["shared_expert_intermediate_size"], shared_gate=True,
            dense_layers=len(dense), route_norm=bool(config.get("norm_topk_prob", False)),
            aux_loss_coeff=moe_hf.aux_coef_from_hf(config, fields, top_k, len(dense)))
    except KeyError as e:
        raise DrScaleError(f"{source}: missing key {e.args[0]!r}") from None
    if len(dense) >= layers:
        raise DrScaleError(f"{source}: every block is in mlp_only_layers (no experts)")
    return fields


def hf_tensors(shape, fused: bool = False) -> list:
    return moe_hf.tensors(shape, dataclasses.replace(NAMES, fused=fused), qkv_bias=True)


_QWEN2_MOE = dict(arch="qwen2_moe", norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=False)

SPEC = MODEL_REGISTRY.register("qwen2_moe", ModelSpec(
    arch="qwen2_moe", module=Qwen2MoeForCausalLM, gated_mlp=True, rotary=True, experts=True,
    tp_plan=moe_hf.ATTENTION_TP_PLAN, sequence_parallel=None,
    hf=HFFormat("Qwen2MoeForCausalLM", "qwen2_moe", hf_config, shape_from_hf,
                tensors=hf_tensors),
    presets={
        # tests and CPU runs: moe_tiny's experts (8, top-2, 352 wide) with a gated shared
        # expert of 352, unnormalised top-k weights (Qwen1.5-MoE's norm_topk_prob false), the
        # first block dense (704)
        "qwen2_moe_tiny": dict(_QWEN2_MOE, hidden_size=256, num_layers=4, num_heads=8,
                               num_kv_heads=2, ffn_hidden_size=704, max_seq_length=1024,
                               vocab_size=4096,
                               moe=dict(num_experts=8, top_k=2, expert_ffn=352, shared_ffn=352,
                                        shared_gate=True, dense_layers=1, route_norm=False)),
        # Qwen1.5-MoE-A2.7B: 60 experts of 1408, top-4, a shared expert of 5632
        "qwen1_5_moe_a2_7b": dict(_QWEN2_MOE, hidden_size=2048, num_layers=24, num_heads=16,
                                  num_kv_heads=16, ffn_hidden_size=5632, max_seq_length=8192,
                                  vocab_size=151936,
                                  moe=dict(num_experts=60, top_k=4, expert_ffn=1408,
                                           shared_ffn=5632, shared_gate=True,
                                           route_norm=False)),
    }))
