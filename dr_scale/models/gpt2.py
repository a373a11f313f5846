"""GPT-2-style decoder: LayerNorm, GeLU MLP, learned positions, biases, tied embeddings."""
import torch
from torch import nn

from dr_scale.models.layers import GeluMLP, LayerNorm, SelfAttention, causal_lm_loss
from dr_scale.models.lm_head import LMHead, fuses_loss
from dr_scale.models.spec import ModelSpec, PipelineLayout
from dr_scale.registry import MODEL_REGISTRY


class GPT2Block(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.ln_1 = LayerNorm(shape.hidden_size, eps=shape.norm_eps)
        self.attn = SelfAttention(shape, bias=True)
        self.ln_2 = LayerNorm(shape.hidden_size, eps=shape.norm_eps)
        self.mlp = GeluMLP(shape.hidden_size, shape.ffn_hidden_size)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x, doc_ids=None):
        x = x + self.drop(self.attn(self.ln_1(x), doc_ids=doc_ids))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.wpe = nn.Embedding(shape.max_seq_length, shape.hidden_size)
        self.drop = nn.Dropout(shape.dropout)
        self.h = nn.ModuleList(GPT2Block(shape) for _ in range(shape.num_layers))
        self.ln_f = LayerNorm(shape.hidden_size, eps=shape.norm_eps)
        self.lm_head = LMHead(shape.hidden_size, shape.vocab_size, shape.loss_chunk)
        if shape.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.loss_function = causal_lm_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor = None,
                doc_ids: torch.Tensor = None, position_ids: torch.Tensor = None):
        """As LlamaForCausalLM.forward; `position_ids` index the learned position table."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) \
            if position_ids is None else position_ids
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x, doc_ids)
        x = self.ln_f(x)
        if labels is not None and fuses_loss(self.lm_head):
            return self.lm_head(x, labels)  # never whole logits (models/lm_head.py)
        logits = self.lm_head(x)  # also under tensor parallelism: a vocabulary slice
        if labels is None:
            return logits
        return self.loss_function(logits, shift_labels=labels)


PIPELINE = PipelineLayout(embedding="wte", positions="wpe", dropout="drop", blocks="h",
                          norm="ln_f")

_GPT2 = dict(arch="gpt2", tie_embeddings=True, norm_eps=1e-5, rope_theta=10000.0)

SPEC = MODEL_REGISTRY.register("gpt2", ModelSpec(
    arch="gpt2", module=GPT2LMHeadModel, gated_mlp=False, pipeline=PIPELINE,
    embedding_weight="wte.weight",
    tp_plan=(
        {"patterns": [r".*\.attn\.[qkv]_proj\.weight$", r".*\.mlp\.fc_in\.weight$"],
         "partition_type": "column"},
        {"patterns": [r".*\.attn\.o_proj\.weight$", r".*\.mlp\.fc_out\.weight$"],
         "partition_type": "row"},
    ),
    presets={
        "gpt2_tiny": dict(_GPT2, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                          ffn_hidden_size=1024, max_seq_length=1024, vocab_size=4096),
        "gpt2_124m": dict(_GPT2, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                          ffn_hidden_size=3072, max_seq_length=1024, vocab_size=50257),
    }))
