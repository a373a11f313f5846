"""Triton kernels against the torch reference, forward and gradients, under the policy's
tolerances: on CPU through the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py)."""
import pytest
import torch

from dr_scale.errors import DrScaleError
from dr_scale.kernels import cross_entropy, flash_attention, policy, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_close(got, want, dtype, pol, what):
    atol, rtol = pol.tol(dtype).atol, pol.tol(dtype).rtol
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= atol * max(1.0, scale) + rtol * scale, f"{what}: max error {err:.2e} (scale {scale:.2e})"


@pytest.mark.smoke
@pytest.mark.parametrize("b, h, kvh, s, d, causal, dtype", [
    (1, 2, 2, 64, 64, True, torch.float32),      # block multiple
    (2, 4, 2, 33, 64, True, torch.float32),      # grouped-query, odd length
    (1, 4, 1, 50, 64, False, torch.float32),     # multi-query, full attention
    (1, 2, 2, 1, 64, True, torch.float32),       # a single token
    (1, 2, 1, 40, 128, True, torch.float32),     # head_dim 128
    (1, 2, 2, 23, 80, True, torch.float32),      # head_dim 80 (padded inside the kernel)
    (1, 4, 2, 37, 64, True, torch.bfloat16),     # bf16: interpreter upcast path
    (1, 2, 2, 29, 96, False, torch.float16),
])
def test_flash_attention_matches_reference(b, h, kvh, s, d, causal, dtype):
    g = torch.Generator().manual_seed(s * d + h)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(DEVICE, dtype) for n in (h, kvh, kvh))
    do = torch.randn(b, h, s, d, generator=g).to(DEVICE, dtype)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = flash_attention(q, k, v, causal=causal)
    out.backward(do)
    # Reference: eager attention in fp32 on the same (rounded) inputs.
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=causal)
    ref.backward(do.float())
    assert out.dtype == dtype and out.shape == q.shape
    pol = policy.ATTENTION
    assert_close(out, ref, dtype, pol, "output")
    for name, got, want in (("dq", q.grad, q32.grad), ("dk", k.grad, k32.grad),
                            ("dv", v.grad, v32.grad)):
        assert got.dtype == dtype
        assert_close(got, want, dtype, pol, name)


@pytest.mark.smoke
@pytest.mark.parametrize("sq, sk", [(20, 45), (45, 20), (33, 64)])
def test_unequal_query_and_key_lengths(sq, sk):
    """The reference equals fp64 SDPA (top-left causal mask) when query and key lengths differ,
    with no NaN where queries outnumber keys; the Triton kernel equals the reference there."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(sq * sk)
    q = torch.randn(1, 4, sq, 64, generator=g)
    k, v = (torch.randn(1, 2, sk, 64, generator=g) for _ in range(2))
    ref = reference.attention(q, k, v, causal=True)
    want = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                          v.double().repeat_interleave(2, 1), is_causal=True)
    assert not ref.isnan().any()
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    q, k, v = (x.to(DEVICE).requires_grad_() for x in (q, k, v))
    out = flash_attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=True)
    ref.backward(torch.ones_like(ref))
    pol = policy.ATTENTION
    assert_close(out, ref, torch.float32, pol, "output")
    for name, got, want in (("dq", q.grad, q32.grad), ("dk", k.grad, k32.grad),
                            ("dv", v.grad, v32.grad)):
        assert_close(got, want, torch.float32, pol, name)


@pytest.mark.parametrize("tokens, vocab, dtype", [(7, 2500, torch.float32), (16, 256, torch.float32),
                                                  (9, 515, torch.bfloat16)])
def test_cross_entropy_matches_reference(tokens, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(tokens, vocab, generator=g)).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    labels[1] = -100  # ignored
    loss = cross_entropy(logits, labels)
    loss.backward()
    l32 = logits.detach().float().requires_grad_()
    ref = reference.cross_entropy(l32, labels)
    ref.backward()
    assert loss.dtype == torch.float32
    pol = policy.CROSS_ENTROPY
    assert_close(loss.detach().reshape(1), ref.detach().reshape(1), dtype, pol, "loss")
    assert_close(logits.grad, l32.grad, dtype, pol, "dlogits")
    assert logits.grad[1].abs().max() == 0  # the ignored row gets no gradient


def test_every_dot_of_the_attention_kernels_keeps_fp32_in_fp32():
    """On GPUs tl.dot computes fp32 inputs in TF32 unless told otherwise (the interpreter here
    computes every dot in full precision, so only the source can show it): every dot of the
    attention kernels goes through the helper that asks for IEEE fp32 on fp32 tiles."""
    import ast
    import inspect

    from dr_scale.kernels.triton import attention_kernels

    dots = [node for node in ast.walk(ast.parse(inspect.getsource(attention_kernels)))
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.dot"]
    assert len(dots) == 2
    assert [ast.unparse(k) for k in dots[0].keywords] == ["input_precision='ieee'"]
    assert ast.unparse(dots[1].keywords and dots[1].keywords[0] or dots[1]) == "tl.dot(a, b)"
    helper = inspect.getsource(attention_kernels._dot.fn)
    assert "if a.dtype == tl.float32:" in helper


def test_outside_the_policy_is_one_line():
    q = torch.randn(1, 2, 8, 64, dtype=torch.float64)
    with pytest.raises(DrScaleError, match=r"^kernels.attention=triton_flash: fp64 inputs are "
                                           r"outside its precision policy \(accepts fp32, bf16, fp16\)$"):
        flash_attention(q, q, q)
    with pytest.raises(DrScaleError, match="inputs must share one dtype, got bf16, fp32"):
        flash_attention(q.float(), q.bfloat16(), q.bfloat16())
    bf16_only = policy.PrecisionPolicy(inputs=(torch.bfloat16,))
    with pytest.raises(DrScaleError, match="fp16 inputs are outside its precision policy"):
        bf16_only.check("op", "impl", torch.zeros(2, dtype=torch.float16))
    with pytest.raises(DrScaleError, match="heads a multiple of kv_heads"):
        flash_attention(*(torch.randn(1, n, 8, 64, device=DEVICE) for n in (3, 2, 2)))


@pytest.mark.smoke
def test_the_interpreter_refuses_the_versions_it_cannot_run_in_one_line():
    """Triton 3.6 (torch 2.11's) interpreter beside NumPy 2.4 fails inside every kernel with a
    loop over key blocks (triton-lang/triton#9171); the kernels say so before launching."""
    from dr_scale.kernels.triton import interpreter_conflict

    assert interpreter_conflict("3.6.0", "2.4.1") == (
        "the Triton 3.6.0 interpreter cannot run beside NumPy 2.4.1 (triton-lang/triton#9171, "
        "fixed in Triton 3.7): install 'numpy<2.4' or 'triton>=3.7'")
    for triton_version, numpy_version in (("3.6.0", "2.3.5"), ("3.7.0", "2.4.1"),
                                          ("3.9.0+git1", "2.4.0"), ("3.6.0", "1.26.4")):
        assert interpreter_conflict(triton_version, numpy_version) is None


def test_tiny_model_trains_with_triton_kernels_like_sdpa(cache_dir, tmp_path):
    """The tiny preset through the real launcher with model.attention=triton_flash and the fused
    cross-entropy (interpreter on CPU), against the same run with SDPA and the torch loss."""
    import json

    from tests.conftest import launch
    from tests.test_train_distributed import fp32_config

    args = ["--ds_config", fp32_config(tmp_path, 1), "data.seq_length=32", "train.max_steps=3",
            "train.log_interval=1", "train.eval_interval=100", "train.save_interval=100",
            "train.eval_samples=2", "train.micro_batch_size=2", "train.global_batch_size=2",
            "train.warmup_steps=0", "train.lr=3e-3", "logging.plot=false",
            "model.num_layers=1"]  # the interpreter runs each program in numpy: one layer
    losses = {}
    for name, extra in (("sdpa", []), ("triton", ["model.attention=triton_flash",
                                                  "model.kernels={cross_entropy: triton_fused}"])):
        run = tmp_path / name
        proc = launch(["--run_dir", run, *args, *extra], 1, cache_dir, launcher="python")
        if name == "triton":
            assert "cross_entropy=triton_fused, attention=triton_flash" in proc.stdout
        recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in recs if "loss" in r] + \
            [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert len(losses["sdpa"]) == 5  # 3 steps + evaluation at 0 and 3
    assert losses["sdpa"][2] < losses["sdpa"][0] - 0.05  # it does learn over these steps
    rtol = policy.ATTENTION.tol(torch.float32).rtol
    for a, b in zip(losses["triton"], losses["sdpa"]):
        assert abs(a - b) <= rtol * abs(b), (losses["triton"], losses["sdpa"])


def _attention_grads(q, k, v, do, causal=True, doc_ids=None):
    out = flash_attention(q, k, v, causal=causal, doc_ids=doc_ids)
    out.backward(do)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=causal, doc_ids=doc_ids)
    ref.backward(do.float())
    return out, ref, (q.grad, k.grad, v.grad), (q32.grad, k32.grad, v32.grad)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
@pytest.mark.parametrize("sq, sk, causal, docs", [(70, 70, True, False), (40, 90, True, False),
                                                  (90, 40, True, False), (70, 70, False, False),
                                                  (96, 96, True, True)])
def test_unequal_query_and_key_blocks(blocks, sq, sk, causal, docs, monkeypatch):
    """BLOCK_M != BLOCK_N both ways: the split between unmasked and edge blocks (forward, dK/dV,
    dQ), with lengths that end mid-block, unequal query and key lengths, and documents."""
    from dr_scale.kernels.triton import attention_kernels as fa

    monkeypatch.setattr(fa, "INTERPRET_BLOCKS", blocks)
    g = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(2, 4, sq, 32, generator=g).to(DEVICE).requires_grad_()
    k, v = (torch.randn(2, 2, sk, 32, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    do = torch.randn(2, 4, sq, 32, generator=g).to(DEVICE)
    doc_ids = None
    if docs:  # documents of 30, 41 and 25 tokens; the second row one document
        doc_ids = torch.tensor([[0] * 30 + [1] * 41 + [2] * 25, [0] * 96],
                               dtype=torch.int32, device=DEVICE)
    out, ref, grads, want = _attention_grads(q, k, v, do, causal, doc_ids)
    assert_close(out, ref, torch.float32, policy.ATTENTION, "output")
    for name, got, exp in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got, exp, torch.float32, policy.ATTENTION, name)


def test_strided_inputs_are_read_in_place():
    """q, k, v as the model makes them: (batch, seq, heads, head_dim) projections transposed.
    The kernel keeps the views (no copies saved for backward) and its output keeps their layout,
    so transposing back is free; values and gradients equal the reference."""
    g = torch.Generator().manual_seed(5)
    b, s, h, kvh, d = 2, 37, 4, 2, 32
    qkv = torch.randn(b, s, h + 2 * kvh, d, generator=g).to(DEVICE).requires_grad_()
    q, k, v = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + kvh].transpose(1, 2), \
        qkv[:, :, h + kvh:].transpose(1, 2)
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, causal=True)
    saved = out.grad_fn.saved_tensors[:3]
    assert [t.data_ptr() for t in saved] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert out.transpose(1, 2).is_contiguous()  # (b, s, h, d) as the output projection wants
    do = torch.randn(b, h, s, d, generator=g).to(DEVICE)
    out.backward(do)
    ref_in = qkv.detach().clone().requires_grad_()
    rq, rk, rv = ref_in[:, :, :h].transpose(1, 2), ref_in[:, :, h:h + kvh].transpose(1, 2), \
        ref_in[:, :, h + kvh:].transpose(1, 2)
    ref = reference.attention(rq, rk, rv, causal=True)
    ref.backward(do)
    assert_close(out, ref, torch.float32, policy.ATTENTION, "output")
    assert_close(qkv.grad, ref_in.grad, torch.float32, policy.ATTENTION, "d(qkv)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 64])  # not dividing the tokens, one chunk
def test_fused_lm_head_with_triton_chunks_equals_torch_and_whole_logits(dtype, chunk):
    """The fused LM head (models/lm_head.py) with cross_entropy=triton_fused: each chunk's loss
    and logits gradient from the Triton kernels, written over the 16-bit logits in place. Loss
    and both gradients against the whole logits (fp32 reference) under the policy's tolerance,
    and against the torch chunk path, which must agree at least as closely."""
    from dr_scale.kernels import ops
    from dr_scale.models.lm_head import linear_cross_entropy

    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 40, 32, generator=g).to(DEVICE, dtype)
    weight = (0.3 * torch.randn(515, 32, generator=g)).to(DEVICE, dtype)
    labels = torch.randint(0, 515, (2, 40), generator=g).to(DEVICE)
    labels[0, :5] = -100  # ignored tokens leave the mean and get no gradient

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        (0.5 * loss).backward()
        return loss.detach(), h.grad, w.grad

    def fused(h, w):
        return linear_cross_entropy(h, w, labels, chunk)

    def whole(h, w):
        return reference.cross_entropy((h.float() @ w.float().t()), labels)

    want = run(whole)
    torch_path = run(fused)
    ops.use_kernels(DEVICE, dtype, forced={"cross_entropy": "triton_fused"})
    try:
        triton_path = run(fused)
        with torch.no_grad():  # the loss alone: the forward kernel only
            alone = fused(hidden, weight)
    finally:
        ops.reset()
    pol = policy.CROSS_ENTROPY
    for got, ref, what in zip(triton_path, want, ("loss", "hidden gradient", "weight gradient")):
        assert got.dtype == (torch.float32 if what == "loss" else dtype)
        assert_close(got.reshape(-1), ref.reshape(-1).float(), dtype, pol, what)
    for got, ref, what in zip(triton_path, torch_path, ("loss", "hidden gradient", "weight gradient")):
        assert_close(got.reshape(-1), ref.reshape(-1).float(), dtype, pol, f"{what} vs torch chunks")
    assert torch.equal(alone, triton_path[0])
    assert triton_path[1][0, :5].abs().max() == 0


def test_vocabulary_parallel_fused_head_with_triton_slices_equals_whole_logits(tmp_path):
    """The fused head over a vocabulary-parallel slice (two gloo ranks, uneven slices, ignored
    tokens, targets at both slices' edges) with cross_entropy=triton_fused: each slice's
    log-sum-exp and target logits from the forward kernel, combined over the group, and its
    gradient written in place by the backward kernel; loss and gradients against the whole
    logits on one process (fp32 1e-5, bf16 2e-2)."""
    from tests.test_lm_head import check_vocabulary_parallel_loss

    check_vocabulary_parallel_loss(tmp_path, "triton_fused")
