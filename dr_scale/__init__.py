"""dr_scale: pretraining decoder language models with DeepSpeed."""
from dr_scale.errors import DrScaleError

__version__ = "0.1.0"
__all__ = ["DrScaleError", "__version__"]
