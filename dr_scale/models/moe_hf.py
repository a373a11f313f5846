"""What the mixture-of-experts families share in transformers' form: their checkpoint tensors
from ours (each family names its router, experts and shared experts), transformers 5's fused
expert layout (read on import), the routing settings a family's transformers class cannot
express (refused on export, in one line), and the load-balancing coefficient's conversion.

transformers' coefficient: its load-balancing loss pools every layer's routing and is top_k at
balance; ours (models/moe.py) is 1 per MoE layer at balance and summed over them, so the same
pull on the router is router_aux_loss_coef = ours x MoE layers / top_k (exact at balance).
"""
from dataclasses import dataclass
from typing import Optional

import torch

from dr_scale.errors import DrScaleError
from dr_scale.models.spec import HFTensor

# attention only: the experts are not split by tensor parallelism
ATTENTION_TP_PLAN = (
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.self_attn\.[qkv]_proj\.bias$"],
     "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"})


@dataclass(frozen=True)
class Names:
    """Where a family's transformers checkpoint keeps a MoE block's tensors (under
    model.layers.N.)."""
    router: str = "mlp.gate"
    expert: str = "mlp.experts.{e}.{w}"                       # one tensor per expert
    projections: tuple = ("gate_proj", "down_proj", "up_proj")  # theirs for our w1, w2, w3
    fused: bool = False          # transformers 5: mlp.experts.gate_up_proj and down_proj
    shared: Optional[str] = None       # the shared experts' SwiGLU
    shared_gate: Optional[str] = None  # its sigmoid gate
    bias: Optional[str] = None         # the routing bias


FUSED = Names(fused=True)


def tensors(shape, names: Names, qkv_bias: bool = False) -> list:
    d, vocab = shape.hidden_size, shape.vocab_size
    moe = shape.moe
    f, kv = moe.expert_width(shape.ffn_hidden_size), shape.num_kv_heads * shape.head_dim

    def copy(theirs, rows_cols, ours=None):
        return HFTensor(theirs, rows_cols, (ours or theirs,))

    out = [copy("model.embed_tokens.weight", (vocab, d)), copy("model.norm.weight", (d,))]
    if not shape.tie_embeddings:
        out.append(copy("lm_head.weight", (vocab, d)))
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}"
        out += [copy(f"{layer}.{n}.weight", (d,))
                for n in ("input_layernorm", "post_attention_layernorm")]
        for p, rows in (("q", d), ("k", kv), ("v", kv), ("o", d)):
            out.append(copy(f"{layer}.self_attn.{p}_proj.weight", (rows, d)))
            if qkv_bias and p != "o":
                out.append(copy(f"{layer}.self_attn.{p}_proj.bias", (rows,)))
        if not moe.is_moe_layer(i):
            out += _swiglu(f"{layer}.mlp", f"{layer}.mlp", d, shape.ffn_hidden_size)
            continue
        out.append(copy(f"{layer}.{names.router}.weight", (moe.num_experts, d),
                        f"{layer}.mlp.gate.weight"))
        if moe.expert_bias:
            if names.bias is None:
                raise DrScaleError("the routing's bias has no place in this family's "
                                   "transformers checkpoint")
            out.append(copy(f"{layer}.{names.bias}", (moe.num_experts,),
                            f"{layer}.mlp.gate.expert_bias"))
        stacked = [f"{layer}.mlp.experts.{w}" for w in ("w1", "w2", "w3")]
        if names.fused:
            out += [HFTensor(f"{layer}.mlp.experts.gate_up_proj", (moe.num_experts, 2 * f, d),
                             (stacked[0], stacked[2]),
                             join=lambda ts: torch.cat(ts, dim=1),
                             split=lambda t: list(t.chunk(2, dim=1))),
                    HFTensor(f"{layer}.mlp.experts.down_proj", (moe.num_experts, d, f),
                             (stacked[1],))]
        else:
            for e in range(moe.num_experts):
                for ours, theirs, rows_cols in zip(stacked, names.projections,
                                                   ((f, d), (d, f), (f, d))):
                    out.append(HFTensor(f"{layer}.{names.expert.format(e=e, w=theirs)}.weight",
                                        rows_cols, (ours,), index=e))
        if moe.shared_experts or moe.shared_ffn:
            if names.shared is None:
                raise DrScaleError("shared experts have no place in this family's "
                                   "transformers checkpoint")
            out += _swiglu(f"{layer}.{names.shared}", f"{layer}.mlp.shared_experts", d,
                           moe.shared_width(shape.ffn_hidden_size))
            if moe.shared_gate:
                out.append(copy(f"{layer}.{names.shared_gate}.weight", (1, d),
                                f"{layer}.mlp.shared_gate.weight"))
    return out


def _swiglu(theirs: str, ours: str, d: int, f: int) -> list:
    return [HFTensor(f"{theirs}.{p}.weight", rows_cols, (f"{ours}.{p}.weight",))
            for p, rows_cols in (("gate_proj", (f, d)), ("up_proj", (f, d)),
                                 ("down_proj", (d, f)))]


def refuse_unless(shape, architecture: str, **expected):
    """One line where the shape's routing is not what `architecture` computes: `expected` maps
    a model.moe field to its required value (shared_experts, expert_bias, expert_ffn and
    shared_gate: whether the shape may have them)."""
    moe = shape.moe
    have = {"score": moe.score, "route_norm": moe.route_norm, "route_scale": moe.route_scale,
            "dense_layers": moe.dense_layers,
            "shared_experts": bool(moe.shared_experts or moe.shared_ffn),
            "shared_gate": moe.shared_gate, "expert_bias": moe.expert_bias,
            "expert_ffn": moe.expert_width(shape.ffn_hidden_size) != shape.ffn_hidden_size}
    for key, want in expected.items():
        if have[key] != want:
            raise DrScaleError(f"export: model.moe.{key}={have[key]} cannot be expressed by "
                               f"transformers' {architecture} (it computes {key}={want}); "
                               f"{_family_hint(key)}")


def _family_hint(key: str) -> str:
    return {"score": "sigmoid scores export as glm4_moe",
            "route_norm": "unnormalised top-k weights export as qwen2_moe",
            "shared_experts": "shared experts export as qwen2_moe (gated) or glm4_moe",
            "shared_gate": "a gated shared expert exports as qwen2_moe",
            "expert_bias": "a routing bias exports as glm4_moe"}.get(
                key, "train the family whose transformers class computes it")


def moe_layers(shape) -> int:
    return shape.num_layers - shape.moe.dense_layers


def aux_coef_to_hf(shape) -> float:
    return _tidy(shape.moe.aux_loss_coeff * moe_layers(shape) / shape.moe.top_k)


def aux_coef_from_hf(config: dict, fields: dict, top_k: int, dense_layers: int = 0) -> float:
    coef = config.get("router_aux_loss_coef", 0.001)
    return _tidy(coef * top_k / (fields["num_layers"] - dense_layers))


def _tidy(x: float) -> float:
    """The conversion's rounding left out, so a round trip gives the number it started from."""
    return float(f"{x:.12g}")
