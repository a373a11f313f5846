"""Plain nn.Module decoders, one file per family, each registering its ModelSpec
(dr_scale/models/spec.py) in MODEL_REGISTRY: importing a family's file is what adds it."""
from dr_scale.models import (gpt2, glm4_moe, llama, mixtral, qwen2,  # noqa: F401
                              qwen2_moe)  # (registration)
from dr_scale.models.build import all_presets, build_model, resolve_shape  # noqa: F401
