"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Parameter names follow Hugging Face's LlamaForCausalLM (model.layers.N.self_attn.q_proj, ...), so
export and import are a copy, not a translation; rotary embeddings use the same half-split
layout, so no q/k permutation is needed either.
"""
import torch
from torch import nn

from dr_scale.errors import DrScaleError
from dr_scale.models.layers import RMSNorm, Rotary, SelfAttention, SwiGLU, causal_lm_loss
from dr_scale.models.lm_head import LMHead, logits_or_loss
from dr_scale.models.rope_scaling import RopeScaling
from dr_scale.models.spec import HFFormat, ModelSpec, PipelineLayout
from dr_scale.registry import MODEL_REGISTRY


class LlamaBlock(nn.Module):
    def __init__(self, shape, qkv_bias: bool = False, index: int = 0):
        """`index`: the block's place (a family whose blocks differ by depth reads it)."""
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.self_attn = SelfAttention(shape, bias=qkv_bias, out_bias=False)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.ffn_hidden_size)

    def forward(self, x, rotary, doc_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), rotary, doc_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, shape, qkv_bias: bool = False, block=LlamaBlock):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(block(shape, qkv_bias, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.rotary = Rotary(shape.head_dim, shape.max_seq_length, shape.rope_theta,
                             shape.rope_scaling)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False  # biases on the q, k, v projections (a subclass may want them)
    block = LlamaBlock  # the decoder block (a subclass may swap its MLP)

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape, self.qkv_bias, self.block)
        self.lm_head = LMHead(shape.hidden_size, shape.vocab_size, shape.loss_chunk)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_function = causal_lm_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor = None,
                doc_ids: torch.Tensor = None, position_ids: torch.Tensor = None):
        """Logits (batch, seq, vocab); with labels, the mean cross-entropy (fp32) instead.
        Packed documents (data/documents.py): `doc_ids` keeps attention within each document,
        `position_ids` restarts the rotary positions at each one."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary(input_ids.shape[1], position_ids)
        for layer in self.model.layers:
            x = layer(x, rotary, doc_ids)
        x = self.model.norm(x)
        return logits_or_loss(self, x, labels)


# Megatron-style: column-parallel where the block fans out, row-parallel where it writes back
# into the residual stream (one all-reduce per attention and per MLP).
TP_PLAN = (
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(gate|up)_proj\.weight$"],
     "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"],
     "partition_type": "row"},
)


def hf_config(shape, eod_id: int, architecture="LlamaForCausalLM", model_type="llama") -> dict:
    rope = {"rope_type": "default"} if shape.rope_scaling is None else shape.rope_scaling.to_hf()
    scaling = {} if shape.rope_scaling is None else {"rope_scaling": shape.rope_scaling.to_hf()}
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_act": "silu",
        "max_position_embeddings": shape.max_seq_length, "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        # transformers 5 reads rope_parameters; earlier releases rope_theta and rope_scaling
        "rope_parameters": {**rope, "rope_theta": shape.rope_theta}, **scaling,
        "tie_word_embeddings": shape.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": shape.init_std, "bos_token_id": 1, "eos_token_id": eod_id,
        "torch_dtype": "float32", "dtype": "float32",
    }


def shape_from_hf(config: dict, source: str) -> dict:
    """Model fields (for the `model:` config section) from a Hugging Face Llama config.json."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise DrScaleError(f"{source}: attention or MLP biases are not supported")
    return decoder_fields(config, source, "llama")


def decoder_fields(config: dict, source: str, arch: str) -> dict:
    """The fields of a Llama-layout config.json (rotary, RMSNorm, gated MLP, grouped-query
    attention) for the family `arch`."""
    try:
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0)
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        scaling = RopeScaling.parse(rope, f"{source}: rope_parameters")
        heads = config["num_attention_heads"]
        if config.get("head_dim", config["hidden_size"] // heads) * heads != config["hidden_size"]:
            raise DrScaleError(f"{source}: head_dim x heads != hidden_size is not supported")
        return dict(arch=arch, hidden_size=config["hidden_size"],
                    num_layers=config["num_hidden_layers"], num_heads=heads,
                    num_kv_heads=config.get("num_key_value_heads", heads),
                    ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                    max_seq_length=config.get("max_position_embeddings", 2048),
                    tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                    norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                    rope_scaling=None if scaling is None else scaling.to_hf())
    except KeyError as e:
        raise DrScaleError(f"{source}: missing key {e.args[0]!r}") from None


PIPELINE = PipelineLayout(embedding="model.embed_tokens", blocks="model.layers",
                          norm="model.norm", rotary="model.rotary")

_LLAMA = dict(arch="llama", tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0)

SPEC = MODEL_REGISTRY.register("llama", ModelSpec(
    arch="llama", module=LlamaForCausalLM, gated_mlp=True, rotary=True, tp_plan=TP_PLAN,
    sequence_parallel=("model.embed_tokens", "lm_head"), pipeline=PIPELINE,
    hf=HFFormat("LlamaForCausalLM", "llama", hf_config, shape_from_hf),
    presets={
        # The embedded default: trains on two CPU cores in minutes.
        "tiny": dict(_LLAMA, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                     ffn_hidden_size=704, max_seq_length=1024, vocab_size=4096,
                     tie_embeddings=True),
        "llama_125m": dict(_LLAMA, hidden_size=768, num_layers=12, num_heads=12,
                           num_kv_heads=12, ffn_hidden_size=2048, max_seq_length=2048,
                           vocab_size=32000, tie_embeddings=True),
        # Llama-3.2-1B shape, its long-context rotary scaling included.
        "llama_1b": dict(_LLAMA, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=8192, max_seq_length=4096, vocab_size=128256,
                         tie_embeddings=True, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
        # Llama-2-7B and Llama-2-70B shapes.
        "llama_7b": dict(_LLAMA, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=32, ffn_hidden_size=11008, max_seq_length=4096,
                         vocab_size=32000),
        "llama_70b": dict(_LLAMA, hidden_size=8192, num_layers=80, num_heads=64,
                          num_kv_heads=8, ffn_hidden_size=28672, max_seq_length=4096,
                          vocab_size=32000),
    }))
