"""For tests/test_compile.py: the registered torch RMSNorm, LayerNorm and SwiGLU behind a linear
layer, eagerly and inside torch.compile; prints {op dtype: the largest gradient error relative to
that gradient's largest element} as JSON."""
import json

import torch

from dr_scale.kernels.registry import implementation


def worst_error(op: str, dtype: torch.dtype) -> float:
    torch.manual_seed(0)
    fn = implementation(op, "torch").fn
    lin = torch.nn.Linear(64, 64).to(dtype)
    w = torch.nn.Parameter((1 + 0.1 * torch.randn(64)).to(dtype))
    b = torch.nn.Parameter((0.1 * torch.randn(64)).to(dtype))
    calls = {"rms_norm": lambda h: fn(h, w, 1e-5), "layer_norm": lambda h: fn(h, w, b, 1e-5),
             "swiglu": lambda h: fn(h, h * w)}
    x0 = torch.randn(4, 33, 64).to(dtype)
    grads = []
    for region in (lambda x: calls[op](lin(x)), torch.compile(lambda x: calls[op](lin(x)))):
        for p in (lin.weight, lin.bias, w, b):
            p.grad = None
        x = x0.clone().requires_grad_()
        region(x).float().pow(2).sum().backward()
        grads.append([t.grad.float() for t in (x, lin.weight, w) + ((b,) if op == "layer_norm"
                                                                   else ())])
    worst = 0.0
    for eager, compiled in zip(*grads):
        scale = eager.abs().max().item()
        assert scale > 0, op
        worst = max(worst, (compiled - eager).abs().max().item() / scale)
    return worst


if __name__ == "__main__":
    print(json.dumps({f"{op} {dtype}": worst_error(op, getattr(torch, dtype))
                      for op in ("rms_norm", "layer_norm", "swiglu")
                      for dtype in ("float32", "bfloat16")}))
