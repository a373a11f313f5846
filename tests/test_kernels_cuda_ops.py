"""The fused kernels as torch.library ops (kernels/cuda/library.py), checked through their CPU
implementations: registrations sound (torch.library.opcheck: schema, fake, autograd, AOT
dispatch), forward and backward equal to the reference ops within the precision policy, and a
block of them compiled with fullgraph=True (what `model.compile` needs: no graph break at our
ops) giving the eager values. On a GPU the same ops run the extension (tests/test_kernels_gpu.py)."""
import pytest
import torch

from dr_scale.kernels import cuda, reference
from dr_scale.kernels import policy as P
from dr_scale.kernels.cuda import library

ROWS, COLS = 24, 64


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g) * scale + offset).to(dtype)
    return {"x": t(ROWS, COLS), "w": t(COLS, scale=0.1, offset=1.0), "b": t(COLS, scale=0.1),
            "q": t(2, 3, 8, 16), "gate": t(ROWS, COLS), "up": t(ROWS, COLS)}


def cases(i):
    cos, sin = reference.rotary_tables(8, 16, 10000.0)
    return {
        "rms_norm": (cuda.rms_norm, lambda x, w: reference.rms_norm(x, w, 1e-5),
                     [i["x"], i["w"]], {"eps": 1e-5}, P.NORM),
        "layer_norm": (cuda.layer_norm, lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
                       [i["x"], i["w"], i["b"]], {"eps": 1e-5}, P.NORM),
        "swiglu": (cuda.swiglu, reference.swiglu, [i["gate"], i["up"]], {}, P.ELEMENTWISE),
        "bias_gelu": (cuda.bias_gelu, reference.bias_gelu, [i["x"], i["b"]], {}, P.ELEMENTWISE),
        "rotary": (lambda q: cuda.apply_rotary(q, cos, sin),
                   lambda q: reference.apply_rotary(q, cos, sin), [i["q"]], {}, P.ELEMENTWISE),
    }


def test_registrations_pass_opcheck():
    i = inputs(torch.float32)
    cos, sin = reference.rotary_tables(8, 16, 10000.0)
    req = {k: v.clone().requires_grad_() for k, v in i.items()}
    x, w, b = req["x"], req["w"], req["b"]
    y, rstd = library.rms_norm_fwd(i["x"], i["w"], 1e-5)
    _, mean, lrstd = library.layer_norm_fwd(i["x"], i["w"], i["b"], 1e-5)
    calls = [
        (library.rms_norm_fwd, (x, w, 1e-5)),
        (library.rms_norm_bwd, (i["up"], i["x"], i["w"], rstd)),
        (library.layer_norm_fwd, (x, w, b, 1e-5)),
        (library.layer_norm_bwd, (i["up"], i["x"], i["w"], mean, lrstd)),
        (library.swiglu_fwd, (req["gate"], req["up"])),
        (library.swiglu_bwd, (i["x"], i["gate"], i["up"])),
        (library.bias_gelu_fwd, (x, b)),
        (library.bias_gelu_bwd, (i["up"], i["x"], i["b"])),
        (library.rotary, (req["q"], cos, sin, 1.0)),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_equal_the_reference(dtype):
    for name, (fused, ref, args, kwargs, policy) in cases(inputs(dtype)).items():
        tol = policy.tol(dtype)
        a = [t.clone().requires_grad_() for t in args]
        r = [t.float().clone().requires_grad_() for t in args]
        out, want = fused(*a, **kwargs), ref(*r)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        out.backward(dy.to(dtype))
        want.backward(dy)
        assert out.dtype == dtype, name
        for got, exp, what in [(out, want, "output"), *((x.grad, y.grad, "grad")
                                                       for x, y in zip(a, r))]:
            scale = exp.abs().max().item()
            err = (got.float() - exp.detach()).abs().max().item()
            assert err <= tol.atol + tol.rtol * scale, (name, what, dtype, err, scale)


def test_a_compiled_block_keeps_one_graph_through_the_ops():
    """fullgraph=True fails on any graph break; the compiled block's values and gradients equal
    the eager ones (the same CPU implementations, so within fp32 rounding). Graph breaks are
    decided by dynamo's trace, the same for every backend: aot_eager also runs the fake and
    autograd registrations, without inductor's C++ build (42 s of this 2-core machine)."""
    cos, sin = reference.rotary_tables(8, 16, 10000.0)

    def block(x, w, b, gate, up, q):
        h = cuda.rms_norm(x, w, 1e-5) + cuda.layer_norm(x, w, b, 1e-5)
        h = cuda.swiglu(h, up) + cuda.bias_gelu(gate, b)
        return h.sum() + cuda.apply_rotary(q, cos, sin).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    i = inputs(torch.float32)
    names = ["x", "w", "b", "gate", "up", "q"]
    eager_in = [i[n].clone().requires_grad_() for n in names]
    comp_in = [i[n].clone().requires_grad_() for n in names]
    want, got = block(*eager_in), compiled(*comp_in)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(comp_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
