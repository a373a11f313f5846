"""The experts of a mixture-of-experts block: SwiGLU of each expert over its contiguous rows.
`x` holds the routed rows grouped by expert, `counts[e]` of them for expert e; w1 (gate) and w3
(up) are experts x ffn x hidden, w2 (down) experts x hidden x ffn.

- grouped_mm: three grouped matmuls, one kernel per projection over all experts
  (torch._grouped_mm, on CPU as on GPU; where the GPU's grouped kernel takes bf16 only, the
  measurement finds it failing in fp32 and takes the loop);
- loop: one expert at a time (no grouped kernel needed).

`swiglu`: the run's SwiGLU (kernels/ops.py hands over the implementation chosen for op
`swiglu`; the torch form where called directly, as the measurement does).
"""
import torch
import torch.nn.functional as F

from dr_scale.kernels.lean_torch import swiglu as torch_swiglu


def grouped_mm_unavailable():
    return None if hasattr(torch, "_grouped_mm") else "this torch has no torch._grouped_mm"


def experts_grouped_mm(x, w1, w2, w3, counts, swiglu=torch_swiglu):
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(swiglu(gate, up), w2.transpose(-2, -1), offs=offsets)


def experts_loop(x, w1, w2, w3, counts, swiglu=torch_swiglu):
    outs = [F.linear(swiglu(F.linear(rows, w1[e]), F.linear(rows, w3[e])), w2[e])
            for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
