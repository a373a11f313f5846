"""Attention implementations selectable by name (`model.attention`): the kernel registry's
attention implementations (kernels/builtin.py), under the same names."""
from dr_scale.kernels import builtin, reference
from dr_scale.registry import ATTENTION_REGISTRY

ATTENTION_REGISTRY.register("sdpa")(builtin.attention_sdpa)
ATTENTION_REGISTRY.register("eager")(reference.attention)
ATTENTION_REGISTRY.register("triton_flash")(builtin.attention_triton)
