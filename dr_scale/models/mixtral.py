"""Mixtral-style mixture-of-experts decoder: the Llama block (RMSNorm, rotary, grouped-query
attention) with its MLP replaced by top-k of N SwiGLU experts (models/moe.py), and the MoE
decoder the other expert families (qwen2_moe.py, glm4_moe.py) build on: optional dense first
blocks and shared experts come from the shape (model.moe).

Parameter names follow transformers' MixtralForCausalLM in memory (model.layers.N.mlp.gate,
.mlp.experts); the experts are stacked per projection (w1, w2, w3), and the folder transformers
writes and reads keeps one tensor per expert (block_sparse_moe.experts.E.w1.weight): export and
import slice or stack them (models/moe_hf.py).
"""
from torch import nn

from dr_scale.errors import DrScaleError
from dr_scale.models import llama, moe_hf
from dr_scale.models.layers import RMSNorm, SelfAttention, SwiGLU
from dr_scale.models.moe import SparseMoE, router_losses
from dr_scale.models.spec import HFFormat, ModelSpec
from dr_scale.registry import MODEL_REGISTRY


class MixtralBlock(nn.Module):
    def __init__(self, shape, qkv_bias: bool = False, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.self_attn = SelfAttention(shape, bias=qkv_bias, out_bias=False)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        if shape.moe.is_moe_layer(index):
            self.mlp = SparseMoE(shape.hidden_size, shape.ffn_hidden_size, shape.moe)
        else:  # DeepSeek's dense first blocks: the model's MLP width
            self.mlp = SwiGLU(shape.hidden_size, shape.ffn_hidden_size)

    def forward(self, x, rotary, doc_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), rotary, doc_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class MixtralForCausalLM(llama.LlamaForCausalLM):
    """Training: the returned loss is the LM loss plus the router's weighted auxiliary and z
    losses; `loss_parts` keeps the LM loss and the router's figures apart for the loss line.
    Evaluation (not training): the LM loss alone, as for a dense model."""

    block = MixtralBlock

    def __init__(self, shape):
        if shape.moe is None:
            raise DrScaleError(f"model.moe.num_experts: the {shape.arch} family needs experts")
        if shape.moe.dense_layers >= shape.num_layers:
            raise DrScaleError(f"model.moe.dense_layers={shape.moe.dense_layers}: leaves no "
                               f"mixture-of-experts block of {shape.num_layers}")
        super().__init__(shape)
        self.loss_parts = {}

    def forward(self, input_ids, labels=None, doc_ids=None, position_ids=None):
        out = super().forward(input_ids, labels, doc_ids, position_ids)
        if labels is None or not self.training:
            return out
        router, figures = router_losses([layer.mlp for layer in self.model.layers],
                                        self.shape.moe)
        self.loss_parts = {"lm_loss": out.detach(), **figures}
        return out + router


def hf_config(shape, eod_id: int) -> dict:
    moe = shape.moe
    moe_hf.refuse_unless(shape, "MixtralForCausalLM", score="softmax", route_norm=True,
                         route_scale=1.0, shared_experts=False, dense_layers=0,
                         expert_bias=False, expert_ffn=False)
    cfg = llama.hf_config(shape, eod_id, architecture="MixtralForCausalLM", model_type="mixtral")
    for llama_only in ("attention_bias", "mlp_bias"):
        del cfg[llama_only]
    cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
               router_aux_loss_coef=moe_hf.aux_coef_to_hf(shape), output_router_logits=False,
               router_jitter_noise=0.0, sliding_window=None)
    return cfg


def shape_from_hf(config: dict, source: str) -> dict:
    if config.get("sliding_window"):
        raise DrScaleError(f"{source}: sliding_window={config['sliding_window']} is not supported "
                           "(full causal attention only); set it to null if the window covers "
                           "the context")
    if config.get("router_jitter_noise"):
        raise DrScaleError(f"{source}: router_jitter_noise is not supported (deterministic "
                           "routing); set it to 0")
    fields = llama.decoder_fields(config, source, "mixtral")
    try:
        top_k = config["num_experts_per_tok"]
        fields["moe"] = dict(num_experts=config["num_local_experts"], top_k=top_k,
                             route_norm=True,  # Mixtral always renormalises, top-1 too
                             aux_loss_coeff=moe_hf.aux_coef_from_hf(config, fields, top_k))
    except KeyError as e:
        raise DrScaleError(f"{source}: missing key {e.args[0]!r}") from None
    return fields


def hf_tensors(shape, fused: bool = False) -> list:
    """transformers' checkpoint tensors from ours: the router under `block_sparse_moe.gate`, and
    each expert's w1/w2/w3 one tensor apiece; `fused`: transformers 5's layout in memory
    (`mlp.gate`, `mlp.experts.gate_up_proj` and `down_proj`, all experts in one tensor)."""
    if fused:
        return moe_hf.tensors(shape, moe_hf.FUSED)
    return moe_hf.tensors(shape, moe_hf.Names(
        router="block_sparse_moe.gate",
        expert="block_sparse_moe.experts.{e}.{w}", projections=("w1", "w2", "w3")))


_MIXTRAL = dict(arch="mixtral", tie_embeddings=False, norm_eps=1e-5, rope_theta=1000000.0)

SPEC = MODEL_REGISTRY.register("mixtral", ModelSpec(
    arch="mixtral", module=MixtralForCausalLM, gated_mlp=True, rotary=True, experts=True,
    # attention only: the experts (and any shared experts, dense first MLPs) are not split by
    # tensor parallelism; replicated over the tensor group, they compute the same gradients
    tp_plan=moe_hf.ATTENTION_TP_PLAN,
    # no sequence parallelism: the experts, replicated over the tensor group, would each see a
    # slice of the sequence and need their gradients summed over the group, which AutoTP's
    # replicated parameters do not get
    sequence_parallel=None,
    hf=HFFormat("MixtralForCausalLM", "mixtral", hf_config, shape_from_hf, tensors=hf_tensors),
    presets={
        # CPU runs and tests: 8 experts, top-2; `tiny`'s shape with its MLP width active per
        # token (2 x 352 = 704): the dense model of the same active parameters
        "moe_tiny": dict(_MIXTRAL, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         ffn_hidden_size=352, max_seq_length=1024, vocab_size=4096,
                         tie_embeddings=True, moe=dict(num_experts=8, top_k=2)),
        # OLMoE-1B-7B's expert shape (64 experts, top-8, 1.3B active of 6.9B) in the Mixtral
        # layout (without OLMoE's q/k norms): a small real-sized MoE for estimates
        "moe_1b_7b": dict(_MIXTRAL, hidden_size=2048, num_layers=16, num_heads=16,
                          num_kv_heads=16, ffn_hidden_size=1024, max_seq_length=4096,
                          vocab_size=50304, rope_theta=10000.0,
                          moe=dict(num_experts=64, top_k=8)),
        # Mixtral-8x7B
        "mixtral_8x7b": dict(_MIXTRAL, hidden_size=4096, num_layers=32, num_heads=32,
                             num_kv_heads=8, ffn_hidden_size=14336, max_seq_length=32768,
                             vocab_size=32000, moe=dict(num_experts=8, top_k=2)),
    }))
