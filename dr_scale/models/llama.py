"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Parameter names follow Hugging Face's LlamaForCausalLM (model.layers.N.self_attn.q_proj, ...), so
export and import are a copy, not a translation.
"""
import torch
from torch import nn

from dr_scale.models.layers import (RMSNorm, Rotary, SelfAttention, SwiGLU, causal_lm_loss,
                                    init_weights)
from dr_scale.registry import MODEL_REGISTRY


class LlamaBlock(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.self_attn = SelfAttention(shape, bias=False)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.ffn_hidden_size)

    def forward(self, x, rotary):
        x = x + self.self_attn(self.input_layernorm(x), rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.rotary = Rotary(shape.head_dim, shape.max_seq_length, shape.rope_theta)


@MODEL_REGISTRY.register("llama")
class LlamaForCausalLM(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.device.type != "meta":
            init_weights(self, shape.init_std, shape.num_layers)
        self.loss_function = causal_lm_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor = None):
        """Logits (batch, seq, vocab); with labels, the mean cross-entropy (fp32) instead."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary(input_ids.shape[1])
        for layer in self.model.layers:
            x = layer(x, rotary)
        logits = self.lm_head(self.model.norm(x))
        if labels is None:
            return logits
        return self.loss_function(logits, shift_labels=labels)
