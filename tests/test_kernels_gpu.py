"""Every kernel run for real on a CUDA device against the torch reference, under its precision
policy: the fused CUDA extension (built on first use), Triton flash attention and cross-entropy,
and a training step with every op on its best implementation. Skipped only where no CUDA device
exists (CPU correctness is covered by test_kernels_triton.py under the interpreter and the CUDA
sources by test_kernels_cuda_build.py)."""
import pytest
import torch

from dr_scale.kernels import policy, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got, want, dtype, pol, what):
    atol, rtol = pol.tol(dtype).atol, pol.tol(dtype).rtol
    if dtype == torch.float32:  # Triton's fp32 tl.dot is TF32 on the GPU
        atol, rtol = max(atol, 2e-3), max(rtol, 2e-3)
    scale = want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol * max(1.0, scale) + rtol * scale, f"{what}: {err:.2e} (scale {scale:.2e})"


def grads_of(fn, inputs, dy):
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    out.backward(dy)
    return out, [x.grad for x in inputs if x.requires_grad]


def check_op(fast, ref, inputs, dtype, pol, name):
    out = fast(*inputs)
    dy = torch.randn_like(out)
    got, got_grads = grads_of(fast, inputs, dy)
    want, want_grads = grads_of(ref, [x.float() if x.is_floating_point() else x for x in inputs],
                                dy.float())
    assert got.dtype == dtype
    close(got, want, dtype, pol, f"{name} output")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        close(g, w, dtype, pol, f"{name} grad {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [((3, 37), 1000),    # scalar path (1000 not a pack multiple)
                                        ((4, 300), 4096),   # 128-bit packs, several rows a block
                                        ((2, 5), 8192)])    # the most packs a thread holds
def test_cuda_fused_ops(dtype, rows, cols):
    from dr_scale.kernels import cuda

    dev = "cuda"
    x = torch.randn(*rows, cols, device=dev, dtype=dtype)
    w = (1 + 0.1 * torch.randn(cols, device=dev)).to(dtype)
    b = (0.1 * torch.randn(cols, device=dev)).to(dtype)
    check_op(lambda x, w: cuda.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm(x, w, 1e-5),
             [x, w], dtype, policy.NORM, "rms_norm")
    check_op(lambda x, w, b: cuda.layer_norm(x, w, b, 1e-5),
             lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), [x, w, b], dtype, policy.NORM,
             "layer_norm")
    g, u = torch.randn(2, 50, 704, device=dev, dtype=dtype), torch.randn(2, 50, 704, device=dev, dtype=dtype)
    check_op(cuda.swiglu, reference.swiglu, [g, u], dtype, policy.ELEMENTWISE, "swiglu")
    check_op(cuda.bias_gelu, reference.bias_gelu, [g, b[:704]], dtype, policy.ELEMENTWISE,
             "bias_gelu")
    check_op(cuda.swiglu, reference.swiglu, [x, x.flip(0)], dtype, policy.ELEMENTWISE, "swiglu")
    check_op(cuda.bias_gelu, reference.bias_gelu, [x, b], dtype, policy.ELEMENTWISE, "bias_gelu")
    cos, sin = reference.rotary_tables(45, 64, 10000.0, device=dev)
    q = torch.randn(2, 4, 45, 64, device=dev, dtype=dtype)
    check_op(lambda q: cuda.apply_rotary(q, cos, sin), lambda q: reference.apply_rotary(q, cos, sin),
             [q], dtype, policy.ELEMENTWISE, "rotary")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, h, kvh, s, d, causal", [(2, 8, 8, 1024, 128, True),
                                                     (1, 8, 2, 777, 64, True),
                                                     (2, 4, 4, 300, 80, False)])
def test_flash_attention_on_gpu(b, h, kvh, s, d, causal, dtype):
    from dr_scale.kernels import flash_attention

    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for n in (h, kvh, kvh))
    check_op(lambda q, k, v: flash_attention(q, k, v, causal=causal),
             lambda q, k, v: reference.attention(q, k, v, causal=causal), [q, k, v], dtype,
             policy.ATTENTION, "flash_attention")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_on_gpu(dtype):
    from dr_scale.kernels import cross_entropy

    logits = torch.randn(500, 32000, device="cuda", dtype=dtype)
    labels = torch.randint(0, 32000, (500,), device="cuda")
    labels[:7] = -100
    l1 = logits.clone().requires_grad_()
    l2 = logits.float().clone().requires_grad_()
    cross_entropy(l1, labels).backward()
    reference.cross_entropy(l2, labels).backward()
    close(l1.grad, l2.grad, dtype, policy.CROSS_ENTROPY, "dlogits")


def test_training_step_with_best_kernels_matches_reference():
    """The tiny model, bf16, every op on its best GPU implementation vs all torch references."""
    from dr_scale.kernels import ops
    from dr_scale.models import build_model
    from tests.test_models import shape_of
    import dataclasses

    shape = shape_of("model.preset=tiny", vocab=4096)
    tokens = torch.randint(0, 4096, (4, 257), device="cuda")
    losses = {}
    for name in ("reference", "best"):
        ops.reset()
        if name == "best":
            line = ops.use_kernels("cuda", torch.bfloat16)
            assert "rms_norm=cuda_fused" in line and "cross_entropy=triton_fused" in line
        s = dataclasses.replace(shape, attention="triton_flash" if name == "best" else "sdpa")
        torch.manual_seed(0)
        model = build_model(s).cuda().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for _ in range(3):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    ops.reset()
    for a, b in zip(losses["best"], losses["reference"]):
        assert abs(a - b) < 2e-2 * abs(b), losses


def test_binding_refuses_arguments_the_kernels_would_misread():
    """An fp32 weight beside bf16 input was read as bf16 (garbage); now every argument's device,
    dtype, shape and contiguity is checked in the binding."""
    from dr_scale.kernels.cuda import library

    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda")
    with pytest.raises(RuntimeError, match="rms_norm: weight is Float, the input BFloat16"):
        library.rms_norm_fwd(x, w, 1e-5)
    with pytest.raises(RuntimeError, match="weight has shape \\[128\\], expected \\[256\\]"):
        library.rms_norm_fwd(x, w[:128].bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="swiglu: gate must be contiguous"):
        library.swiglu_fwd(x.t(), x.t().contiguous())
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        library.bias_gelu_fwd(x, w.bfloat16().cpu())


def test_compiled_block_keeps_one_graph_on_gpu():
    """model.compile's view: the CUDA ops inside torch.compile(fullgraph=True), inductor."""
    from dr_scale.kernels import cuda

    def block(x, w, gate, up):
        return cuda.swiglu(cuda.rms_norm(x, w, 1e-5), up).float().sum() + gate.sum()

    x, gate, up = (torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
    w = torch.ones(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True)(x, w, gate, up)
    want = block(x, w, gate, up)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)


def test_auto_measures_and_keeps_only_passing_kernels(tmp_path, monkeypatch):
    from dr_scale.kernels import measured
    from dr_scale.kernels.registry import candidates

    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    p = measured.Problem(batch=2, seq=1024, hidden=2048, ffn=5632, heads=16, kv_heads=4,
                         head_dim=128, vocab=32000, loss_rows=2048)
    found = {op: candidates(op, "cuda", torch.bfloat16)
             for op in ("rms_norm", "swiglu", "attention", "cross_entropy")}
    assert "cuda_fused" in [k.name for k in found["rms_norm"]]
    chosen, table = measured.choose(found, p, "cuda", torch.bfloat16)
    print(measured.format_table(table, p, "cuda", torch.bfloat16))
    for op, name in chosen.items():
        row = next(r for r in table if r.op == op and r.name == name)
        assert row.error <= 1.0 and row.ms > 0


def test_flash_attention_past_two_billion_elements():
    """Batch and head offsets in 64 bits: q, k, v of 2.28e9 elements each (bf16, 4.6 GB), the
    last batch element checked against SDPA (it is where 32-bit offsets wrapped)."""
    import torch.nn.functional as F

    from dr_scale.kernels import flash_attention

    b, h, s, d = 17, 32, 32768, 128
    assert b * h * s * d > 2 ** 31
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q[-1:, :2], k[-1:, :2], v[-1:, :2], is_causal=True)
    close(out[-1:, :2], want, torch.bfloat16, policy.ATTENTION, "last batch element")


def test_grouped_experts_with_uneven_counts_on_gpu():
    """torch's grouped matmul on the GPU in bf16 (the dtype it runs in training; the kernel
    measurement checks fp32 itself and takes the loop where the GPU refuses it) with groups of
    odd sizes and an empty one (padded by kernels/grouped.py): output and gradients equal the
    fp32 loop under the policy."""
    from dr_scale.kernels.grouped import experts_grouped_mm

    dtype = torch.bfloat16
    counts = torch.tensor([0, 1, 37, 130, 5, 64, 211, 7], device="cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, generator=g)
    w = [torch.randn(8, *s, generator=g) * 0.06 for s in ((512, 256), (256, 512), (512, 256))]
    inputs = [t.to("cuda", dtype) for t in (x, *w)] + [counts]
    check_op(experts_grouped_mm, reference.grouped_experts, inputs, dtype,
             policy.GROUPED_MATMUL, "grouped experts")
