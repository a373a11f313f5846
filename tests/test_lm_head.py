"""The fused, chunked LM head + cross-entropy (models/lm_head.py) against the whole logits and
torch's cross-entropy: losses and gradients, per precision, in the model and alone."""
import pytest
import torch
import torch.nn.functional as F

from dr_scale.config.schema import ModelConfig
from dr_scale.kernels.policy import CROSS_ENTROPY
from dr_scale.models import build_model, resolve_shape
from dr_scale.models.lm_head import chunk_tokens, linear_cross_entropy


def reference(hidden, weight, labels):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def grads(fn, hidden, weight, labels, scale=1.0):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * scale).backward()  # a scaled loss, as gradient accumulation's 1/accum
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 64, 4096])  # not dividing, dividing, one chunk
def test_fused_loss_and_gradients_equal_the_whole_logits(dtype, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 43, 32).to(dtype)
    weight = (torch.randn(301, 32) * 0.3).to(dtype)
    labels = torch.randint(0, 301, (3, 43))
    labels[1, :9] = -100  # ignored tokens leave the mean
    fused = grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk), hidden, weight, labels, 0.25)
    whole = grads(reference, hidden, weight, labels, 0.25)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == fused[2].dtype == dtype
    tol = CROSS_ENTROPY.tol(dtype)
    for got, want, what in zip(fused, whole, ("loss", "hidden gradient", "weight gradient")):
        scale = want.abs().max().item()  # gradients compared relative to their largest entry
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol.atol * max(scale, 1.0) + tol.rtol * scale, (what, err, scale)


def test_fused_loss_without_gradients_equals_the_whole_logits():
    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 50, 16), torch.randn(97, 16)
    labels = torch.randint(0, 97, (2, 50))
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, 16)
    assert torch.allclose(got, reference(hidden, weight, labels), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "gpt2_tiny"])
def test_models_train_the_same_fused_and_unfused(preset):
    """Same weights, same batch: the model's loss and every parameter's gradient (the tied
    embedding's included) agree in fp32 between chunks of 40 tokens and whole logits."""
    shapes = [resolve_shape(ModelConfig(preset=preset, loss_chunk_tokens=c, num_layers=2))
              for c in (40, 0)]
    torch.manual_seed(3)
    fused = build_model(shapes[0])
    whole = build_model(shapes[1])
    whole.load_state_dict(fused.state_dict())
    ids = torch.randint(0, shapes[0].vocab_size, (2, 65))
    losses = []
    for model in (fused, whole):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(fused.named_parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name
    with torch.no_grad():  # no labels: the logits, as before
        assert torch.equal(fused(ids), whole(ids))


def test_chunk_rule_bounds_the_logits_and_zero_keeps_them_whole():
    assert chunk_tokens(128256) == 512 and chunk_tokens(32000) == 2048
    assert chunk_tokens(10 ** 9) == 16  # never below 16 tokens
    assert resolve_shape(ModelConfig(preset="llama_1b")).loss_chunk == 512
    assert resolve_shape(ModelConfig(preset="tiny", loss_chunk_tokens=0)).loss_chunk == 0


def test_auto_fuses_only_a_micro_batch_larger_than_one_chunk():
    """Settled per run: llama_1b (vocabulary 128,256: 512-token chunks) fuses 4 x 1,024 tokens
    and keeps 2 x 256 whole; over 8 vocabulary slices (16,032 rows: 4,096-token chunks) 4,096
    tokens stay whole and 8,192 fuse; a value given is kept as given."""
    shape = resolve_shape(ModelConfig(preset="llama_1b"))
    assert shape.settle_loss_chunk(4096).loss_chunk == 512
    assert shape.settle_loss_chunk(512).loss_chunk == 0
    assert shape.settle_loss_chunk(4096, slices=8).loss_chunk == 0
    assert shape.settle_loss_chunk(8192, slices=8).loss_chunk == 4096
    given = resolve_shape(ModelConfig(preset="llama_1b", loss_chunk_tokens=64))
    assert given.settle_loss_chunk(16).loss_chunk == 64


def test_vocabulary_parallel_fused_loss_equals_the_whole_logits(tmp_path):
    """Two ranks, each with its slice of the head (51 and 50 of 101 rows), the loss chunked 8
    tokens at a time with ignored tokens: the loss, the hidden states' gradient (the slices'
    shares summed by DeepSpeed's ColumnParallel) and each slice's weight gradient equal the
    single-process whole-logits cross-entropy (fp32: 1e-5; bf16: the cross-entropy policy)."""
    check_vocabulary_parallel_loss(tmp_path, "torch")


def check_vocabulary_parallel_loss(tmp_path, kernel: str):
    """tests/scripts/vocab_parallel_loss.py with the slices' softmax by `kernel`, checked as
    above (test_kernels_triton.py runs it with the Triton kernels)."""
    import json

    from tests.conftest import run_rank_script

    run_rank_script("vocab_parallel_loss.py", tmp_path, kernel, timeout=240)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result.{rank}").read_text())
        for dtype, tol in (("float32", 1e-5), ("bfloat16", 2e-2)):
            got = r[dtype]
            assert abs(got["loss"] - r["ref"]) <= tol * abs(r["ref"]), (rank, dtype)
            for name in ("grad_h", "grad_w"):
                a, b = torch.tensor(got[name]), torch.tensor(r[f"ref_{name}"])
                assert (a - b).abs().max() <= tol * b.abs().max(), (rank, dtype, name)


def allocator_peak_mib(fn):
    """fn's result and the peak bytes torch's CPU allocator held over the call, above what it
    held before: the running sum of the profiler's allocation records. Not the process's
    resident high-water mark: not every kernel lets a process reset that (CI's did not)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    records = []

    def walk(event):
        if event.tag == _EventType.Allocation:
            records.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    assert records, "the profiler recorded no allocation"
    held = peak = 0
    for _, size in sorted(records):
        held += size
        peak = max(peak, held)
    return out, peak / 2 ** 20


def test_evaluation_under_no_grad_keeps_no_gradient():
    """Under torch.no_grad() (evaluation) the fused head computes only the loss: no fp32
    vocabulary x hidden weight gradient is allocated (it was: needs_input_grad says what the
    inputs require, not whether a backward will come). Peak bytes the allocator held over the
    call, from the profiler's allocation records."""
    vocab, hidden, tokens = 32768, 512, 256  # the weight's gradient: 64 MiB in fp32
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    with torch.no_grad():
        evaluated, eval_mib = allocator_peak_mib(
            lambda: linear_cross_entropy(h, weight, labels, 64))
    trained, train_mib = allocator_peak_mib(lambda: linear_cross_entropy(h, weight, labels, 64))
    assert torch.equal(evaluated, trained.detach())
    # a chunk's logits (8 MiB) and the loss's fp32 transients of them; no 64 MiB gradient
    assert eval_mib < 48, eval_mib
    assert train_mib - eval_mib >= 48, (train_mib, eval_mib)  # the gradient kept for backward
