"""ModelSpec: everything the rest of dr_scale needs to know about one model family, in that
family's file. A new family is one new file that registers its spec (MODEL_REGISTRY) and is
imported by dr_scale/models/__init__.py.

What reads which field:
    module, presets        models.build (shapes, building), `dr-scale presets`
    tp_plan                parallel.tensor (DeepSpeed AutoTP), parallel.estimate
    gated_mlp              the counts below (SwiGLU's three matrices or GeLU's two)
    flops_per_token, recompute_flops_per_token
                           MFU and HFU (train/start.py), `dr-scale presets`
    activation_bytes_per_token_layer
                           the memory estimate (parallel/estimate.py)
    rotary, experts        shape checks
    sequence_parallel      parallel.sequence: where the sequence is split and gathered again
    pipeline               parallel.pipeline (cutting into stages), export (stage files' names)
    hf                     export (config.json, weights' names) and model.init_from (import)
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a transformers checkpoint made from ours: `name` and `shape` there, the
    names of ours it is made of, how (`join`), and back again (`split`: theirs -> ours, in the
    order of `ours`)."""
    name: str
    shape: Tuple[int, ...]
    ours: Tuple[str, ...]
    join: Callable = None                  # [our tensors] -> theirs; None: the one, as it is
    split: Callable = None                 # theirs -> [our tensors]; None: the one, as it is
    index: int = None                      # theirs is ours[index] (one expert of a stack)


@dataclass(frozen=True)
class HFFormat:
    """A Hugging Face transformers architecture: its config, and (where its names or layouts
    differ from ours) the state-dict adapter, torchtitan's pattern. Without one, export and
    import are a copy of the tensors by name."""
    architecture: str                      # e.g. "LlamaForCausalLM"
    model_type: str                        # config.json "model_type"
    to_config: Callable[..., dict]         # (shape, eod_id) -> config.json fields
    from_config: Callable[..., dict]       # (config.json dict, source) -> model fields
    tensors: Optional[Callable[..., List[HFTensor]]] = None  # (shape) -> their tensors


@dataclass(frozen=True)
class PipelineLayout:
    """Where a pipeline's layers are in the model, by attribute path: the token embedding (with
    learned positions and dropout where the family has them) is the first layer, one per decoder
    block, the final norm, the LM head (tied to the embedding or not). A stage's layer file keys
    its tensors by the layer's own names; `model_name` names them back."""
    embedding: str                         # "model.embed_tokens"
    blocks: str                            # the ModuleList of decoder blocks
    norm: str                              # the final norm
    rotary: Optional[str] = None           # the rotary tables, shared by every block
    positions: Optional[str] = None        # learned positions (GPT-2's wpe)
    dropout: Optional[str] = None          # dropout after the embeddings

    def model_name(self, layer: int, key: str, num_layers: int) -> str:
        """The model's name of `key` in pipeline layer `layer` (0 the embedding, 1..L the
        blocks, L + 1 the norm, L + 2 an untied head)."""
        if layer == 0:
            return f"{self.positions}.weight" if key == "positions.weight" else \
                f"{self.embedding}.{key}"
        if layer <= num_layers:
            return f"{self.blocks}.{layer - 1}.{key.removeprefix('block.')}"
        return f"{self.norm}.{key}" if layer == num_layers + 1 else f"lm_head.{key}"

    def pipeline_name(self, name: str, num_layers: int) -> tuple:
        """(layer, key) of the model's parameter `name` in the pipeline: model_name's inverse."""
        if self.positions and name == f"{self.positions}.weight":
            return 0, "positions.weight"
        for prefix, layer in ((self.embedding, 0), (self.norm, num_layers + 1),
                              ("lm_head", num_layers + 2)):
            if name.startswith(prefix + "."):
                return layer, name[len(prefix) + 1:]
        if name.startswith(self.blocks + "."):
            index, key = name[len(self.blocks) + 1:].split(".", 1)
            return int(index) + 1, f"block.{key}"
        raise ValueError(f"{name}: not a parameter of the pipeline's layers")


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    module: Callable                       # ModelShape -> nn.Module
    presets: Dict[str, dict]               # preset name -> shape fields (arch filled in)
    tp_plan: Tuple[dict, ...]              # AutoTP layer specs: column- and row-parallel names
    gated_mlp: bool                        # SwiGLU (3 matrices) rather than GeLU (2)
    rotary: bool = False                   # rotary positions (the head dim must be even)
    sequence_parallel: Optional[Tuple[str, str]] = None  # (embedding, LM head) module names
    pipeline: Optional[PipelineLayout] = None  # None: no pipeline stages
    embedding_weight: str = "model.embed_tokens.weight"  # what a tied LM head shares
    experts: bool = False                  # its MLP is a mixture of experts (model.moe)
    hf: Optional[HFFormat] = None

    def tie_head(self, state: dict, tied: bool) -> dict:
        """`state` with the LM head named too, where it is the embedding (checkpoints and the
        EMA keep a tied weight once, under the embedding's name)."""
        if tied and self.embedding_weight in state:
            state["lm_head.weight"] = state[self.embedding_weight]
        return state

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def active_mlp_params(self, shape) -> float:
        """The MLP matrices' parameters one token passes through in a block, averaged over the
        blocks: the dense MLP; or in a mixture of experts' blocks its top-k experts, any shared
        experts (and their gate) and the router, in its dense first blocks the dense MLP."""
        d, f, m = shape.hidden_size, shape.ffn_hidden_size, self.mlp_matrices
        if shape.moe is None:
            return m * d * f
        moe = shape.moe
        sparse = moe.top_k * m * d * moe.expert_width(f) + d * moe.num_experts
        if moe.shared_experts or moe.shared_ffn:
            sparse += m * d * moe.shared_width(f) + (d if moe.shared_gate else 0)
        dense = moe.dense_layers
        return (dense * m * d * f + (shape.num_layers - dense) * sparse) / shape.num_layers

    def active_parameters(self, shape, total: int) -> int:
        """The parameters one token uses, of `total`: all but the experts it is not routed to."""
        if shape.moe is None:
            return total
        moe = shape.moe
        idle = moe.num_experts - moe.top_k
        return total - (shape.num_layers - moe.dense_layers) * idle * self.mlp_matrices \
            * shape.hidden_size * moe.expert_width(shape.ffn_hidden_size)

    # What one token costs, from the family's block (attention with grouped k/v projections,
    # the MLP's matrices) and a shape: one place for the start line, the metrics, the estimator.
    def flops_per_token(self, shape, seq_length: int) -> float:
        """Training FLOPs per token, the PaLM/Megatron count: 6 x (matmul parameters a token
        passes through, the output projection included, input embeddings not; for a mixture of
        experts its top-k experts and the router: the active parameters) + 12 x layers x hidden
        x sequence (attention scores and values, full square, as those papers count it). No
        recomputation (HFU)."""
        d, L = shape.hidden_size, shape.num_layers
        kv = shape.num_kv_heads * shape.head_dim
        attn = d * d * 2 + d * kv * 2                      # q, o and k, v projections
        matmul_params = L * (attn + self.active_mlp_params(shape)) + d * shape.vocab_size
        return 6.0 * matmul_params + 12.0 * L * d * seq_length

    def recompute_flops_per_token(self, shape, seq_length: int, checkpointing: str,
                                  every: int = 1) -> float:
        """Forward FLOPs per token done again by activation checkpointing (HFU counts them, MFU
        not): whole blocks for `full`, the attention module (projections and scores) for
        `selective`, every `every`-th block."""
        if checkpointing == "none":
            return 0.0
        d = shape.hidden_size
        kv = shape.num_kv_heads * shape.head_dim
        attention = 2.0 * (d * d * 2 + d * kv * 2) + 4.0 * d * seq_length
        mlp = 2.0 * self.active_mlp_params(shape)
        per_layer = attention + (mlp if checkpointing == "full" else 0.0)
        return per_layer * len(range(0, shape.num_layers, every))

    def activation_bytes_per_token_layer(self, shape, bytes_per: int) -> float:
        """Bytes one decoder block keeps for backward, per token, at `bytes_per` an element."""
        h, f = shape.hidden_size, shape.ffn_hidden_size
        kv = shape.num_kv_heads * shape.head_dim
        # two norms: the fused kernels and the torch RMSNorm and LayerNorm
        # (kernels/lean_torch.py) keep their input (and per-row statistics, negligible)
        norms = 2 * bytes_per * h
        attention = bytes_per * (h + (h + 2 * kv) + h + h)  # input, q/k/v, output, o_proj input
        # input; gated (SwiGLU, lean_torch.py or fused): gate, up, their product; GeLU: fc_in
        # output, gelu output; a mixture of experts: that for each of its top-k experts, and
        # the routed copy of the input each one reads, and for its shared experts (averaged
        # over the blocks with its dense first blocks)
        if shape.moe is None:
            return norms + attention + bytes_per * (h + self.mlp_matrices * f)
        moe = shape.moe
        shared = moe.shared_width(f) if (moe.shared_experts or moe.shared_ffn) else 0
        sparse = h + moe.top_k * (self.mlp_matrices * moe.expert_width(f) + h) \
            + self.mlp_matrices * shared
        dense = h + self.mlp_matrices * f
        layers, dense_layers = shape.num_layers, moe.dense_layers
        mlp = (dense_layers * dense + (layers - dense_layers) * sparse) / layers
        return norms + attention + bytes_per * mlp
