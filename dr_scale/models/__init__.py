"""Plain nn.Module decoders, built by name through MODEL_REGISTRY."""
from dr_scale.models import attention, gpt2, llama  # noqa: F401  (registration)
from dr_scale.models.build import build_model, resolve_shape  # noqa: F401
from dr_scale.models.presets import PRESETS  # noqa: F401
