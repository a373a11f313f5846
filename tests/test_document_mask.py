"""Packed documents that don't see each other: document ids and positions from end-of-document
tokens, every attention implementation against fp64 SDPA with the explicit mask (forward and
gradients), the Triton kernel's block skipping, and a packed sequence's logits against its
documents run one by one."""
import pytest
import torch
import torch.nn.functional as F

from dr_scale.data.documents import (DocumentBoundaries, document_ids, positions_in_document,
                                     same_document_causal_mask)
from dr_scale.kernels import policy
from dr_scale.kernels.registry import implementation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_ids_and_positions_from_end_of_document_tokens():
    eod = 2
    x = torch.tensor([[5, 2, 7, 8, 2, 9], [2, 2, 3, 4, 5, 6]])
    ids = document_ids(x, eod)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert positions_in_document(ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    assert DocumentBoundaries(eod, False, False).model_inputs(x) == {}
    both = DocumentBoundaries(eod, True, True).model_inputs(x)
    assert set(both) == {"doc_ids", "position_ids"}
    assert set(DocumentBoundaries(eod, False, True).model_inputs(x)) == {"position_ids"}


def _doc_ids(lengths_per_row, device=DEVICE):
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row]
    return torch.stack(rows).to(device, torch.int32)


LAYOUTS = {
    "three documents, boundaries inside blocks": [[7, 20, 13], [40]],
    "many short documents": [[3, 1, 5, 2, 9, 4, 6, 10], [1] * 40],
    "one document (= causal)": [[40], [40]],
}


CASES = [(impl, layout, torch.float32) for impl in ("eager", "sdpa", "triton_flash")
         for layout in LAYOUTS]
CASES += [(impl, "many short documents", torch.bfloat16) for impl in ("sdpa", "triton_flash")]


@pytest.mark.parametrize("impl, layout, dtype", CASES)
def test_attention_within_documents_matches_fp64_sdpa(impl, layout, dtype):
    doc = _doc_ids(LAYOUTS[layout])
    b, s = doc.shape
    g = torch.Generator().manual_seed(s + len(layout))
    q = torch.randn(b, 4, s, 32, generator=g)
    k, v = (torch.randn(b, 2, s, 32, generator=g) for _ in range(2))
    grad_out = torch.randn(b, 4, s, 32, generator=g)
    mask = same_document_causal_mask(doc.cpu())
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64.repeat_interleave(2, 1),
                                          v64.repeat_interleave(2, 1), attn_mask=mask)
    want.backward(grad_out.double())
    qx, kx, vx = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    got = implementation("attention", impl)(qx, kx, vx, causal=True, doc_ids=doc)
    got.backward(grad_out.to(DEVICE, dtype))
    tol = policy.ATTENTION.tol(dtype)
    for name, a, w in (("out", got, want), ("dq", qx.grad, q64.grad), ("dk", kx.grad, k64.grad),
                       ("dv", vx.grad, v64.grad)):
        scale = w.abs().max().item()
        err = (a.double().cpu() - w).abs().max().item()
        assert err <= tol.atol * max(1.0, scale) + tol.rtol * scale, \
            f"{impl} {name}: max error {err:.2e} (scale {scale:.2e})"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_launch_by_block_mask_equals_the_per_document_calls(layout):
    """The GPU's document path (flex attention over a same-document block mask, one launch)
    against the CPU's (one SDPA call per document), forward in fp32, grouped-query heads; run
    here in flex attention's eager form (its compiled kernel and the gradients run on a GPU:
    test_attention_within_documents_matches_fp64_sdpa there, through `sdpa`)."""
    from dr_scale.kernels.builtin import attention_by_block_mask

    doc = _doc_ids(LAYOUTS[layout], "cpu")
    g = torch.Generator().manual_seed(len(layout))
    q = torch.randn(doc.shape[0], 4, doc.shape[1], 32, generator=g)
    k, v = (torch.randn(doc.shape[0], 2, doc.shape[1], 32, generator=g) for _ in range(2))
    got = attention_by_block_mask(q, k, v, doc, causal=True, gqa=True, compiled=False)
    want = implementation("attention", "sdpa")(q, k, v, causal=True, doc_ids=doc)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_documents_change_the_output():
    """The mask is applied: with two documents the second one's output differs from causal."""
    doc = _doc_ids([[10, 10]])
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    for impl in ("eager", "sdpa", "triton_flash"):
        attend = implementation("attention", impl)
        full, packed = attend(q, k, v, causal=True), attend(q, k, v, causal=True, doc_ids=doc)
        torch.testing.assert_close(packed[:, :, :10], full[:, :, :10], atol=1e-5, rtol=1e-5)
        assert (packed[:, :, 10:] - full[:, :, 10:]).abs().max() > 1e-2, impl


def test_triton_visits_only_blocks_that_share_a_document():
    """Per query block, the first key visited; per key block, the last query visited (block
    sizes 16 x 16). Documents [0, 40), [40, 41), [41, 100)."""
    from dr_scale.kernels.triton.attention_kernels import _key_starts, _query_ends

    doc = _doc_ids([[40, 1, 59]])
    # query blocks start at 0, 16, 32, 48, 64, 80: their first documents start at key 0, 0, 0,
    # 41 (block 32), 41, 41 -> floored to key blocks of 16
    assert _key_starts(doc, 16, 16).tolist() == [[0, 0, 0, 32, 32, 32, 32]]
    # key blocks end at keys 15, 31, 47, 63, 79, 95, 99: the last query of their last document
    assert _query_ends(doc, 16).tolist() == [[40, 40, 100, 100, 100, 100, 100]]


@pytest.mark.parametrize("preset, attention", [("tiny", "sdpa"), ("tiny", "eager"),
                                               ("tiny", "triton_flash"), ("gpt2_tiny", "sdpa")])
def test_packed_sequence_equals_its_documents_run_alone(preset, attention):
    """A packed sample of three documents with document masking and positions reset gives, for
    each document's tokens, the logits of that document run by itself (fp32, 1e-5); without
    them the later documents' logits differ (they see the earlier documents)."""
    from dr_scale.config import load_config
    from dr_scale.models import build_model, resolve_shape

    eod = 2
    shape = resolve_shape(load_config(overrides=[f"model.preset={preset}",
                                                 f"model.attention={attention}"]).model, None)
    torch.manual_seed(0)
    model = build_model(shape).to(DEVICE).eval()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, shape.vocab_size, (n,), generator=g) for n in (11, 29, 20)]
    docs = [torch.cat([d, torch.tensor([eod])]) for d in docs]
    packed = torch.cat(docs)[None].to(DEVICE)
    boundaries = DocumentBoundaries(eod, mask=True, reset_positions=True)
    with torch.no_grad():
        together = model(packed, **boundaries.model_inputs(packed))
        plain = model(packed)
        start = 0
        for d in docs:
            alone = model(d[None].to(DEVICE))
            part = together[:, start:start + len(d)]
            torch.testing.assert_close(part, alone, atol=1e-5, rtol=1e-5)
            if start:
                assert (plain[:, start:start + len(d)] - alone).abs().max() > 1e-3
            start += len(d)


def test_selection_refuses_what_cannot_take_packed_documents_or_dropout():
    from dr_scale.errors import DrScaleError
    from dr_scale.kernels.registry import select

    assert "positions per token" in implementation("rotary", "cuda_fused").supports(
        per_token_positions=True)
    assert implementation("rotary", "cuda_fused").supports(per_token_positions=False) is None
    with pytest.raises(DrScaleError, match=r"kernels.attention=triton_flash: cannot run here: it "
                                           r"has no attention dropout \(model.dropout=0.1\)"):
        select("attention", "cpu", torch.float32, force="triton_flash", dropout=0.1)
