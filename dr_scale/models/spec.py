"""ModelSpec: everything the rest of dr_scale needs to know about one model family, in that
family's file. A new family is one new file that registers its spec (MODEL_REGISTRY) and is
imported by dr_scale/models/__init__.py.

What reads which field:
    module, presets        models.build (shapes, building), `dr-scale presets`
    tp_plan                parallel.tensor (DeepSpeed AutoTP), parallel.estimate
    gated_mlp              FLOPs per token (MFU), recomputed FLOPs (HFU), activation bytes
    rotary                 shape checks
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
