"""Kernel registry and dispatch: the best available implementation per op, forced choices, and
one-line errors for what cannot run here."""
import pytest
import torch

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops, reference
from dr_scale.kernels.registry import KERNELS, select


@pytest.fixture(autouse=True)
def _reset_ops():
    yield
    ops.reset()


def test_every_op_has_a_torch_reference_and_a_faster_implementation():
    select("rms_norm", "cpu")  # loads the built-in registrations
    for op in ops.OPS:
        names = set(KERNELS[op])
        if op == "experts":  # torch's grouped matmuls, and one expert at a time
            assert names == {"grouped_mm", "loop"}
            continue
        assert "torch" in names, op
        assert names & {"cuda_fused", "triton_fused"}, op
    assert {"triton_flash", "sdpa", "eager"} <= set(KERNELS["attention"])


def test_auto_on_cpu_picks_torch_and_never_the_interpreter():
    line = ops.use_kernels("cpu", torch.bfloat16)
    assert line == ("kernels: rms_norm=torch, layer_norm=torch, swiglu=torch, bias_gelu=torch, "
                    "rotary=torch, cross_entropy=torch, experts=grouped_mm")
    assert select("attention", "cpu", torch.bfloat16).name == "sdpa"


def test_forced_choice_is_used_by_the_model_ops():
    # on a GPU machine the tests run Triton for real (no interpreter): its tensors live there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops.use_kernels(device, torch.float32, {"cross_entropy": "triton_fused"})
    logits = torch.randn(6, 300, device=device)
    labels = torch.randint(0, 300, (6,), device=device)
    assert torch.allclose(ops.cross_entropy(logits, labels),
                          reference.cross_entropy(logits, labels), rtol=1e-5)
    assert ops._chosen["cross_entropy"].name == "triton_fused"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_what_cannot_run_here_is_one_line():
    with pytest.raises(DrScaleError, match=r"^kernels.rms_norm=cuda_fused: cannot run here: runs "
                                           r"on cuda, not cpu$"):
        ops.use_kernels("cpu", torch.float32, {"rms_norm": "cuda_fused"})
    with pytest.raises(DrScaleError, match=r"kernels.swiglu: unknown implementation 'fast'; "
                                           r"known: cuda_fused, torch"):
        ops.use_kernels("cpu", torch.float32, {"swiglu": "fast"})
    with pytest.raises(DrScaleError, match="head_dim 256 > 128"):
        select("attention", "cpu", torch.float32, force="triton_flash", head_dim=256)


def test_launcher_errors_name_the_config_key(cache_dir, tmp_path):
    from tests.conftest import launch
    from tests.test_cli_errors import errors_of

    proc = launch(["--ds_config", "zero1", "--run_dir", tmp_path / "r",
                   "model.kernels={layernorm: torch}"], 1, cache_dir, launcher="python", check=False)
    assert proc.returncode == 2
    assert errors_of(proc) == ("dr_scale: error: model.kernels.layernorm: unknown op; known: "
                               "rms_norm, layer_norm, swiglu, bias_gelu, rotary, cross_entropy, "
                               "experts")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_implementations_match_the_fp32_reference_under_their_policy(dtype):
    """The registered torch implementations may compute in the input dtype (rotary does); the
    fp32 reference is the measure, within the op's precision policy."""
    from dr_scale.kernels import policy as P
    from dr_scale.kernels.registry import KERNELS

    torch.manual_seed(0)
    x = torch.randn(2, 4, 33, 64, dtype=dtype, requires_grad=True)
    cos, sin = reference.rotary_tables(33, 64, 10000.0)
    grad = torch.randn(2, 4, 33, 64, dtype=dtype)
    got = KERNELS["rotary"]["torch"].fn(x, cos, sin)
    (dx,) = torch.autograd.grad(got, x, grad)
    x32 = x.detach().float().requires_grad_()
    want = reference.apply_rotary(x32, cos, sin)
    (dx32,) = torch.autograd.grad(want, x32, grad.float())
    tol = P.ELEMENTWISE.tol(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(dx.float(), dx32, atol=tol.atol, rtol=tol.rtol)


def _new_bytes_saved(fn, *inputs):
    """Bytes autograd keeps for backward beyond the inputs themselves (which the caller holds)."""
    held = {t.data_ptr() for t in inputs}
    total = [0]

    def pack(t):
        if t.data_ptr() not in held:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, total[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_rms_norm_and_swiglu_keep_only_their_inputs(dtype):
    """The registered torch RMSNorm and SwiGLU (kernels/lean_torch.py): the reference's outputs
    bit for bit and its gradients within the op's policy, while keeping for backward nothing
    but their inputs and RMSNorm's fp32 statistic per row (the reference keeps an fp32 copy of
    the input and the fp32 normalized output; silu(gate))."""
    from dr_scale.kernels import policy as P
    from dr_scale.kernels.registry import implementation

    torch.manual_seed(0)
    x = torch.randn(2, 33, 256, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(256)).to(dtype).requires_grad_()
    got, kept = _new_bytes_saved(lambda a, b: implementation("rms_norm", "torch").fn(a, b, 1e-5), x, w)
    want, ref_kept = _new_bytes_saved(lambda a, b: reference.rms_norm(a, b, 1e-5), x, w)
    assert torch.equal(got, want)
    # the reference: the fp32 normalized output, and an fp32 copy of a 16-bit input
    assert kept == 2 * 33 * 4 and ref_kept >= (4 if dtype == torch.float32 else 8) * x.numel()
    grad = torch.randn_like(got)
    tol = P.NORM.tol(dtype)
    for a, b in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(a.float(), b.float(), atol=tol.atol, rtol=tol.rtol)

    gate = torch.randn(2, 33, 512, dtype=dtype, requires_grad=True)
    up = torch.randn(2, 33, 512, dtype=dtype, requires_grad=True)
    got, kept = _new_bytes_saved(implementation("swiglu", "torch").fn, gate, up)
    want, ref_kept = _new_bytes_saved(reference.swiglu, gate, up)
    assert torch.equal(got, want) and kept == 0 and ref_kept == gate.numel() * gate.element_size()
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (gate, up), grad),
                    torch.autograd.grad(want, (gate, up), grad)):
        assert torch.equal(a, b)  # the same ops autograd runs for the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_layer_norm_keeps_its_input_and_row_statistics(dtype):
    """The registered torch LayerNorm (kernels/lean_torch.py): the reference's output and
    gradients bit for bit (torch's own LayerNorm kernels, as autograd runs them), keeping the
    input and two fp32 statistics per row (the reference keeps an fp32 copy of a 16-bit input)."""
    from dr_scale.kernels.registry import implementation

    torch.manual_seed(0)
    x = torch.randn(2, 33, 256, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(256)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(256)).to(dtype).requires_grad_()
    fn = implementation("layer_norm", "torch").fn
    got, kept = _new_bytes_saved(lambda x, w, b: fn(x, w, b, 1e-5), x, w, b)
    want, ref_kept = _new_bytes_saved(lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), x, w, b)
    assert torch.equal(got, want)
    assert kept == 2 * 2 * 33 * 4  # mean and rstd per row
    if dtype == torch.bfloat16:
        assert ref_kept >= 4 * x.numel()  # the fp32 copy of the input
    grad = torch.randn_like(got)
    for a, c in zip(torch.autograd.grad(got, (x, w, b), grad),
                    torch.autograd.grad(want, (x, w, b), grad)):
        assert torch.equal(a, c)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons on a CPU-only machine")
def test_why_gpu_implementations_cannot_run_is_collected_for_the_start_line():
    from dr_scale.kernels.registry import unavailable

    found = unavailable("cuda")
    assert sorted(found["needs a CUDA device"]) == sorted(
        ["attention=sdpa_flash", "attention=sdpa_cudnn", "rms_norm=cuda_fused",
         "layer_norm=cuda_fused", "swiglu=cuda_fused", "bias_gelu=cuda_fused",
         "rotary=cuda_fused"])
    assert unavailable("cpu").get("needs a CUDA device") is None
