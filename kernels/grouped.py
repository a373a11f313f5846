"""The experts of a mixture-of-experts block: SwiGLU of each expert over its contiguous rows.
`x` holds the routed rows grouped by expert, `counts[e]` of them for expert e; w1 (gate) and w3
(up) are experts x ffn x hidden, w2 (down) experts x hidden x ffn.

- grouped_mm: three grouped matmuls, one kernel per projection over all experts
  (torch._grouped_mm, on CPU as on GPU; where the GPU's grouped kernel takes bf16 only, the
  measurement finds it failing in fp32 and takes the loop). On a GPU each expert's rows are
  padded with zero rows to a multiple of 16 bytes along the tokens (8 rows in bf16): the weight
  gradients' grouped matmul contracts over the tokens, and the GPU kernel wants each group's
  extent there aligned (torchtitan pads its token groups for the same reason). A zero row
  adds nothing to any weight's gradient and its output is dropped;
- loop: one expert at a time (no grouped kernel needed).

`swiglu`: the run's SwiGLU (kernels/ops.py hands over the implementation chosen for op
`swiglu`; the torch form where called directly, as the measurement does).
"""
import torch
import torch.nn.functional as F

from dr_scale.kernels.lean_torch import swiglu as torch_swiglu


def grouped_mm_unavailable():
    return None if hasattr(torch, "_grouped_mm") else "this torch has no torch._grouped_mm"


ALIGN_BYTES = 16


def experts_grouped_mm(x, w1, w2, w3, counts, swiglu=torch_swiglu, align=None):
    """`align`: rows each expert's group is padded to a multiple of (None: 16 bytes' worth on a
    GPU, none on a CPU, whose kernel takes any counts)."""
    if align is None:
        align = 1 if x.device.type == "cpu" else max(1, ALIGN_BYTES // x.element_size())
    if align > 1:
        x, rows, counts = _pad_groups(x, counts, align)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(swiglu(gate, up), w2.transpose(-2, -1), offs=offsets)
    return out[rows] if align > 1 else out


def _pad_groups(x, counts, align):
    """(x with each group's rows followed by zero rows up to a multiple of `align`, where each
    of x's rows went, the padded counts). Sized by the bound (rows + experts x (align - 1)) so
    that nothing waits on the device for the counts; the last group takes the spare rows, all
    zero, so no row lies past the last offset."""
    experts = counts.numel()
    padded = (counts + align - 1) // align * align
    total = x.shape[0] + experts * (align - 1)
    padded[-1] += total - padded.sum()
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts,
                                            output_size=x.shape[0])
    rows = torch.arange(x.shape[0], device=x.device) + shift[expert_of_row]
    return x.new_zeros(total, x.shape[1]).index_copy(0, rows, x), rows, padded


def experts_loop(x, w1, w2, w3, counts, swiglu=torch_swiglu):
    outs = [F.linear(swiglu(F.linear(rows, w1[e]), F.linear(rows, w3[e])), w2[e])
            for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
