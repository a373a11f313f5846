"""Precision policies: what a kernel accepts, what it computes in fp32, and how close to the fp32
reference it must come. Registered with each implementation; checked on every call, so a tensor
outside the policy is a one-line error rather than a silently wrong result.
"""
from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Tuple

import torch

from dr_scale.errors import DrScaleError

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
_NAMES = {FP32: "fp32", BF16: "bf16", FP16: "fp16", torch.float64: "fp64"}


class Tolerance(NamedTuple):
    """Against the fp32 reference; a NamedTuple so a test reads `.atol`/`.rtol` by name (a
    positional unpack once swapped the two)."""
    atol: float
    rtol: float


def dtype_name(dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class PrecisionPolicy:
    inputs: Tuple[torch.dtype, ...]           # accepted input dtypes (all inputs share one)
    accumulate: torch.dtype = FP32            # matmul / reduction accumulators
    output: str = "input"                     # the output dtype: that of the inputs
    fp32: Tuple[str, ...] = ()                # what always runs in fp32, whatever the inputs
    # (atol, rtol) against the fp32 reference, per input dtype, outputs and gradients alike
    tolerance: Dict[torch.dtype, Tolerance] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "tolerance",
                           {d: Tolerance(*t) for d, t in self.tolerance.items()})

    def check(self, op: str, impl: str, *tensors: torch.Tensor):
        dtypes = {t.dtype for t in tensors if t is not None and t.is_floating_point()}
        if len(dtypes) > 1:
            names = ", ".join(sorted(dtype_name(d) for d in dtypes))
            raise DrScaleError(f"kernels.{op}={impl}: inputs must share one dtype, got {names}")
        for d in dtypes:
            if d not in self.inputs:
                allowed = ", ".join(dtype_name(x) for x in self.inputs)
                raise DrScaleError(f"kernels.{op}={impl}: {dtype_name(d)} inputs are outside its "
                                   f"precision policy (accepts {allowed})")

    def tol(self, dtype) -> Tolerance:
        return self.tolerance[dtype]


# The policies the kernels here register under.
ATTENTION = PrecisionPolicy(
    inputs=(FP32, BF16, FP16), fp32=("scores", "softmax max and sum", "log-sum-exp"),
    tolerance={FP32: (2e-5, 1e-4), BF16: (2e-2, 2e-2), FP16: (3e-3, 3e-3)})
NORM = PrecisionPolicy(
    inputs=(FP32, BF16, FP16), fp32=("mean", "variance", "reciprocal std", "weight gradient"),
    tolerance={FP32: (1e-5, 1e-5), BF16: (2e-2, 2e-2), FP16: (2e-3, 2e-3)})
ELEMENTWISE = PrecisionPolicy(
    inputs=(FP32, BF16, FP16), fp32=("activation and its derivative",),
    tolerance={FP32: (1e-6, 1e-5), BF16: (1e-2, 1e-2), FP16: (1e-3, 1e-3)})
GROUPED_MATMUL = PrecisionPolicy(
    inputs=(FP32, BF16, FP16), fp32=("matmul accumulation",),
    tolerance={FP32: (1e-5, 1e-4), BF16: (2e-2, 2e-2), FP16: (3e-3, 3e-3)})
CROSS_ENTROPY = PrecisionPolicy(
    inputs=(FP32, BF16, FP16), output="fp32",
    fp32=("logit max", "log-sum-exp", "loss", "softmax gradient"),
    tolerance={FP32: (1e-5, 1e-5), BF16: (1e-2, 1e-2), FP16: (1e-3, 1e-3)})
