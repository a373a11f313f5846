"""ModelSpec: everything the rest of dr_scale needs to know about one model family, in that
family's file. A new family is one new file that registers its spec (MODEL_REGISTRY) and is
imported by dr_scale/models/__init__.py.

What reads which field:
    module, presets        models.build (shapes, building), `dr-scale presets`
    tp_plan                parallel.tensor (DeepSpeed AutoTP), parallel.estimate
    gated_mlp              FLOPs per token (MFU), recomputed FLOPs (HFU), activation bytes
    rotary                 shape checks
    sequence_parallel      parallel.sequence: where the sequence is split and gathered again
    pipeline               parallel.pipeline: whether the Llama layout can be cut into stages
    hf                     export (config.json) and model.init_from (import)
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class HFFormat:
    """A Hugging Face transformers architecture whose parameter names are ours (export and
    import are a copy of tensors; only the config is translated)."""
    architecture: str                      # e.g. "LlamaForCausalLM"
    model_type: str                        # config.json "model_type"
    to_config: Callable[..., dict]         # (shape, eod_id) -> config.json fields
    from_config: Callable[..., dict]       # (config.json dict, source) -> model fields


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    module: Callable                       # ModelShape -> nn.Module
    presets: Dict[str, dict]               # preset name -> shape fields (arch filled in)
    tp_plan: Tuple[dict, ...]              # AutoTP layer specs: column- and row-parallel names
    gated_mlp: bool                        # SwiGLU (3 matrices) rather than GeLU (2)
    rotary: bool = False                   # rotary positions (the head dim must be even)
    sequence_parallel: Optional[Tuple[str, str]] = None  # (embedding, LM head) module names
    pipeline: bool = False                 # Llama layout (embed_tokens, layers, norm, lm_head)
    hf: Optional[HFFormat] = None

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2
