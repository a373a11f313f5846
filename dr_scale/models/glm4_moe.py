"""DeepSeek-V3's mixture of experts on Llama attention, as transformers' Glm4MoeForCausalLM
(GLM-4.5) computes it: sigmoid scores, the top k chosen by score plus a per-expert bias that
auxiliary-loss-free balancing moves (train/expert_balance.py), their scores renormalised and
scaled (routed_scaling_factor), shared experts every token passes through, the first blocks
dense (first_k_dense_replace). The attention is the Llama block's: transformers' class is
configured with full rotary (partial_rotary_factor 1), no q/k norms and no attention biases,
and without its multi-token-prediction layers.

Not expressed: DeepSeek-V3's group-limited routing (n_group > 1 is refused on import) and its
multi-head latent attention.
"""
import dataclasses

from dr_scale.errors import DrScaleError
from dr_scale.models import llama, moe_hf
from dr_scale.models.mixtral import MixtralForCausalLM
from dr_scale.models.spec import HFFormat, ModelSpec
from dr_scale.registry import MODEL_REGISTRY


class Glm4MoeForCausalLM(MixtralForCausalLM):
    pass


NAMES = moe_hf.Names(shared="mlp.shared_experts", bias="mlp.gate.e_score_correction_bias")


def hf_config(shape, eod_id: int) -> dict:
    moe = shape.moe
    moe_hf.refuse_unless(shape, "Glm4MoeForCausalLM", score="sigmoid", expert_bias=True,
                         shared_experts=True, shared_gate=False)
    width = moe.expert_width(shape.ffn_hidden_size)
    shared = moe.shared_width(shape.ffn_hidden_size)
    if shared % width:
        raise DrScaleError(f"export: model.moe.shared_ffn={shared} must be a multiple of the "
                           f"expert width {width} (transformers' Glm4MoeForCausalLM counts "
                           "shared experts of that width)")
    cfg = llama.hf_config(shape, eod_id, architecture="Glm4MoeForCausalLM",
                          model_type="glm4_moe")
    del cfg["mlp_bias"]
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    cfg.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
               moe_intermediate_size=width, n_shared_experts=shared // width,
               first_k_dense_replace=moe.dense_layers, norm_topk_prob=moe.route_norm,
               routed_scaling_factor=moe.route_scale, n_group=1, topk_group=1,
               use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0,
               num_nextn_predict_layers=0, output_router_logits=False)
    return cfg


def shape_from_hf(config: dict, source: str) -> dict:
    for key, want in (("attention_bias", False), ("use_qk_norm", False), ("n_group", 1)):
        if config.get(key, want) != want:
            raise DrScaleError(f"{source}: {key}={config[key]} is not supported (expected "
                               f"{want})")
    partial = config.get("partial_rotary_factor",
                         (config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    if partial != 1.0:
        raise DrScaleError(f"{source}: partial_rotary_factor={partial} is not supported "
                           "(rotary over the whole head dimension only)")
    fields = llama.decoder_fields(config, source, "glm4_moe")
    try:
        width = config["moe_intermediate_size"]
        fields["moe"] = dict(
            num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
            expert_ffn=width, shared_experts=config.get("n_shared_experts", 1),
            dense_layers=config.get("first_k_dense_replace", 1), score="sigmoid",
            expert_bias=True, route_norm=bool(config.get("norm_topk_prob", True)),
            route_scale=float(config.get("routed_scaling_factor", 1.0)))
    except KeyError as e:
        raise DrScaleError(f"{source}: missing key {e.args[0]!r}") from None
    return fields


def hf_tensors(shape, fused: bool = False) -> list:
    return moe_hf.tensors(shape, dataclasses.replace(NAMES, fused=fused))


_GLM4_MOE = dict(arch="glm4_moe", norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)

SPEC = MODEL_REGISTRY.register("glm4_moe", ModelSpec(
    arch="glm4_moe", module=Glm4MoeForCausalLM, gated_mlp=True, rotary=True, experts=True,
    tp_plan=moe_hf.ATTENTION_TP_PLAN, sequence_parallel=None,
    hf=HFFormat("Glm4MoeForCausalLM", "glm4_moe", hf_config, shape_from_hf,
                tensors=hf_tensors),
    presets={
        # tests and CPU runs: 8 sigmoid-scored experts of 176, top-2, one shared expert, the
        # first block dense (704), balanced by the routing bias instead of a loss; at 0.01 a
        # step (DeepSeek-V3's 0.001 is for runs of 100,000s of steps: from a collapsed router
        # moe_tiny came within 1.3x in 158 steps at 0.01, oscillated at 0.02; moe_balance.py)
        "deepseek_moe_tiny": dict(_GLM4_MOE, hidden_size=256, num_layers=4, num_heads=8,
                                  num_kv_heads=4, ffn_hidden_size=704, max_seq_length=1024,
                                  vocab_size=4096,
                                  moe=dict(num_experts=8, top_k=2, expert_ffn=176,
                                           shared_experts=1, dense_layers=1, score="sigmoid",
                                           bias_update_rate=0.01, aux_loss_coeff=0.0,
                                           route_scale=1.0)),
        # DeepSeekMoE-16B's expert shape (64 experts of 1408, top-6, 2 shared, the first block
        # dense at 10944) routed as DeepSeek-V3 routes (sigmoid, bias, scale 2.5)
        "deepseek_moe_16b": dict(_GLM4_MOE, hidden_size=2048, num_layers=28, num_heads=16,
                                 num_kv_heads=16, ffn_hidden_size=10944, max_seq_length=4096,
                                 vocab_size=102400,
                                 moe=dict(num_experts=64, top_k=6, expert_ffn=1408,
                                          shared_experts=2, dense_layers=1, score="sigmoid",
                                          bias_update_rate=0.001, aux_loss_coeff=0.0001,
                                          aux_loss_scope="sequence", route_scale=2.5)),
    }))
