"""GPT-2-style decoder: LayerNorm, GeLU MLP, learned positions, biases, tied embeddings."""
import torch
from torch import nn

from dr_scale.models.layers import GeluMLP, LayerNorm, SelfAttention, causal_lm_loss
from dr_scale.models.lm_head import LMHead, logits_or_loss
from dr_scale.errors import DrScaleError
from dr_scale.models.spec import HFFormat, HFTensor, ModelSpec, PipelineLayout
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
        return logits_or_loss(self, x, labels)


def hf_config(shape, eod_id: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": shape.vocab_size, "n_positions": shape.max_seq_length,
        "n_embd": shape.hidden_size, "n_layer": shape.num_layers, "n_head": shape.num_heads,
        "n_inner": shape.ffn_hidden_size, "activation_function": "gelu_new",  # tanh GeLU
        "resid_pdrop": shape.dropout, "embd_pdrop": shape.dropout, "attn_pdrop": shape.dropout,
        "layer_norm_epsilon": shape.norm_eps, "initializer_range": shape.init_std,
        "scale_attn_weights": True, "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": eod_id, "eos_token_id": eod_id, "torch_dtype": "float32",
        "dtype": "float32",
    }


def shape_from_hf(config: dict, source: str) -> dict:
    """Model fields from a transformers GPT-2 config.json; what our blocks do not compute is
    refused."""
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise DrScaleError(f"{source}: activation_function {config['activation_function']!r}: "
                           "only the tanh GeLU (gelu_new) is supported")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx"):
        raise DrScaleError(f"{source}: attention scaled other than by 1/sqrt(head dim) is not "
                           "supported")
    try:
        d = config["n_embd"]
        return dict(arch="gpt2", hidden_size=d, num_layers=config["n_layer"],
                    num_heads=config["n_head"], num_kv_heads=config["n_head"],
                    ffn_hidden_size=config.get("n_inner") or 4 * d,
                    vocab_size=config["vocab_size"], max_seq_length=config["n_positions"],
                    tie_embeddings=bool(config.get("tie_word_embeddings", True)),
                    norm_eps=config.get("layer_norm_epsilon", 1e-5))
    except KeyError as e:
        raise DrScaleError(f"{source}: missing key {e.args[0]!r}") from None


def hf_tensors(shape) -> list:
    """transformers' GPT2LMHeadModel tensors from ours: under `transformer.`, q/k/v fused into
    c_attn, and the matrices of its Conv1D layers stored transposed (inputs x outputs)."""
    if shape.num_kv_heads != shape.num_heads:
        raise DrScaleError(f"model.num_kv_heads={shape.num_kv_heads}: transformers' GPT-2 has "
                           f"as many key/value heads as query heads ({shape.num_heads})")
    d, f = shape.hidden_size, shape.ffn_hidden_size

    def same(theirs, ours, shape_):
        return HFTensor(theirs, shape_, (ours,))

    def conv1d(theirs, ours, rows, cols):  # our (out, in) matrix, their (in, out)
        return HFTensor(theirs, (cols, rows), (ours,), join=lambda ts: ts[0].t(),
                        split=lambda t: [t.t()])

    out = [same("transformer.wte.weight", "wte.weight", (shape.vocab_size, d)),
           same("transformer.wpe.weight", "wpe.weight", (shape.max_seq_length, d))]
    for i in range(shape.num_layers):
        ours, theirs = f"h.{i}", f"transformer.h.{i}"
        qkv = tuple(f"{ours}.attn.{p}_proj" for p in "qkv")
        out += [same(f"{theirs}.{ln}.{k}", f"{ours}.{ln}.{k}", (d,))
                for ln in ("ln_1", "ln_2") for k in ("weight", "bias")]
        out += [HFTensor(f"{theirs}.attn.c_attn.weight", (d, 3 * d),
                         tuple(f"{p}.weight" for p in qkv),
                         join=lambda ts: torch.cat(ts).t(), split=lambda t: t.t().split(d)),
                HFTensor(f"{theirs}.attn.c_attn.bias", (3 * d,), tuple(f"{p}.bias" for p in qkv),
                         join=torch.cat, split=lambda t: t.split(d)),
                conv1d(f"{theirs}.attn.c_proj.weight", f"{ours}.attn.o_proj.weight", d, d),
                same(f"{theirs}.attn.c_proj.bias", f"{ours}.attn.o_proj.bias", (d,)),
                conv1d(f"{theirs}.mlp.c_fc.weight", f"{ours}.mlp.fc_in.weight", f, d),
                same(f"{theirs}.mlp.c_fc.bias", f"{ours}.mlp.fc_in.bias", (f,)),
                conv1d(f"{theirs}.mlp.c_proj.weight", f"{ours}.mlp.fc_out.weight", d, f),
                same(f"{theirs}.mlp.c_proj.bias", f"{ours}.mlp.fc_out.bias", (d,))]
    out += [same(f"transformer.ln_f.{k}", f"ln_f.{k}", (d,)) for k in ("weight", "bias")]
    if not shape.tie_embeddings:
        out.append(same("lm_head.weight", "lm_head.weight", (shape.vocab_size, d)))
    return out


PIPELINE = PipelineLayout(embedding="wte", positions="wpe", dropout="drop", blocks="h",
                          norm="ln_f")

_GPT2 = dict(arch="gpt2", tie_embeddings=True, norm_eps=1e-5, rope_theta=10000.0)

SPEC = MODEL_REGISTRY.register("gpt2", ModelSpec(
    arch="gpt2", module=GPT2LMHeadModel, gated_mlp=False, pipeline=PIPELINE,
    embedding_weight="wte.weight",
    hf=HFFormat("GPT2LMHeadModel", "gpt2", hf_config, shape_from_hf, tensors=hf_tensors),
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
