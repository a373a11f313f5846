"""Kernels chosen by measurement (kernels/measured.py): what GPUs run under `auto`, checked here
through the CPU implementations. A kernel outside its precision policy is never chosen, the
fastest passing one is, the choice is cached by device, versions and shape, and on several ranks
rank 0 decides for all."""
import dataclasses
import json

import pytest
import torch

from dr_scale.errors import DrScaleError
from dr_scale.kernels import measured
from dr_scale.kernels.registry import candidates
from tests.conftest import run_rank_script

PROBLEM = measured.Problem(batch=2, seq=128, hidden=128, ffn=256, heads=4, kv_heads=2,
                           head_dim=32, vocab=500, loss_rows=256, experts=4, expert_ffn=96,
                           top_k=2)


def counted(kernel, calls, scale=1.0, name=None):
    """The real kernel, its calls counted; `scale` != 1 makes it wrong by that factor."""
    def fn(*args, **kwargs):
        calls[name or kernel.name] = calls.get(name or kernel.name, 0) + 1
        out = kernel.fn(*args, **kwargs)
        return out * scale if scale != 1.0 else out
    return dataclasses.replace(kernel, fn=fn, name=name or kernel.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_kernel_is_never_chosen_and_the_fastest_passing_one_is(dtype, monkeypatch,
                                                                        tmp_path):
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    calls = {}
    norm = candidates("rms_norm", "cpu", dtype)[0]
    wrong = counted(norm, calls, scale=1.1, name="ten_percent_off")
    attention = [counted(k, calls) for k in candidates("attention", "cpu", dtype)]
    assert [k.name for k in attention] == ["sdpa", "eager"]
    chosen, table = measured.choose({"rms_norm": [wrong, norm], "attention": attention},
                                    PROBLEM, "cpu", dtype)
    rows = {(r.op, r.name): r for r in table}
    bad = rows["rms_norm", "ten_percent_off"]
    assert bad.error > 1.0 and bad.ms is None and bad.verdict == "outside its precision policy"
    assert chosen["rms_norm"] == "torch" and rows["rms_norm", "torch"].error <= 1.0
    timed = [r for r in table if r.op == "attention"]
    assert all(r.error <= 1.0 and r.ms > 0 for r in timed)
    assert chosen["attention"] == min(timed, key=lambda r: r.ms).name
    assert [r.name for r in table if r.chosen] == ["torch", chosen["attention"]]
    # one check call, a warm-up and five timed calls per passing kernel; the wrong one only checked
    assert calls == {"ten_percent_off": 1, "sdpa": 7, "eager": 7}
    printed = measured.format_table(table, PROBLEM, "cpu", dtype)
    assert "measured now" in printed and "outside its precision policy" in printed

    # the same job again: read from the cache, nothing called, the same table
    calls.clear()
    again, cached_table = measured.choose({"rms_norm": [wrong, norm], "attention": attention},
                                          PROBLEM, "cpu", dtype)
    assert again == chosen and calls == {}
    assert [(r.name, r.ms, r.error) for r in cached_table] == \
        [(r.name, r.ms, r.error) for r in table]
    assert "all from" in measured.format_table(cached_table, PROBLEM, "cpu", dtype)
    # another shape is another entry: measured again
    longer = dataclasses.replace(PROBLEM, seq=256)
    measured.choose({"attention": attention}, longer, "cpu", dtype)
    assert calls == {"sdpa": 7, "eager": 7}
    assert len(json.loads((tmp_path / measured.CACHE).read_text())) == 3


def test_the_check_catches_what_a_broken_kernel_gets_wrong(monkeypatch, tmp_path):
    """Each op's check: its output and every input gradient against the fp32 reference."""
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    for op in ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rotary", "cross_entropy",
               "attention", "experts"):
        for dtype in (torch.float32, torch.bfloat16):
            for k in candidates(op, "cpu", dtype):
                assert measured.check_error(k, PROBLEM, "cpu", dtype) <= 1.0, (op, k.name, dtype)
    sdpa = candidates("attention", "cpu", torch.float32)[0]
    no_mask = dataclasses.replace(sdpa, fn=lambda q, k, v, causal=True, **kw: sdpa.fn(
        q, k, v, causal=False, **kw))  # a kernel that forgets the causal mask
    assert measured.check_error(no_mask, PROBLEM, "cpu", torch.bfloat16) > 10
    documents = dataclasses.replace(PROBLEM, documents=4)  # one that ignores document bounds
    no_docs = dataclasses.replace(sdpa, fn=lambda q, k, v, doc_ids=None, **kw: sdpa.fn(
        q, k, v, **kw))
    assert measured.check_error(sdpa, documents, "cpu", torch.float32) <= 1.0
    assert measured.check_error(no_docs, documents, "cpu", torch.float32) > 10


def test_nothing_passes_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    norm = candidates("rms_norm", "cpu", torch.float32)[0]
    with pytest.raises(DrScaleError, match=r"^kernels.rms_norm: no implementation passed its "
                                           r"precision check here \(doubled: outside its "
                                           r"precision policy; raises: failed: boom\)$"):
        measured.choose({"rms_norm": [counted(norm, {}, 2.0, "doubled"),
                                      dataclasses.replace(norm, name="raises", fn=_raise)]},
                        PROBLEM, "cpu", torch.float32)


def _raise(*args, **kwargs):
    raise RuntimeError("boom\nmore lines")


def test_rank_zero_measures_and_every_rank_takes_its_choice(tmp_path):
    run_rank_script("kernel_choice.py", tmp_path, timeout=180)
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1)]
    assert results[0]["chosen"] == results[1]["chosen"]
    assert results[0]["chosen"]["attention"] in ("sdpa", "eager")
    assert results[0]["called"] > 0 and results[1]["called"] == 0
    assert results[0]["cache_entries"] == 1 and results[1]["cache_entries"] == 0
    # a refusal on rank 0 reaches every rank as the same error (none waits for the choice)
    assert results[0]["error"] == results[1]["error"]
    assert results[1]["error"].startswith("kernels.rms_norm: no implementation passed")


def test_when_nothing_can_be_timed_the_last_checked_implementation_is_used(monkeypatch, tmp_path):
    """An implementation that passes its check at the capped shape but cannot run at the run's
    (out of memory there, say) is not a reason to stop: the lowest-priority one that passed its
    check is used, and the table says it was not timed."""
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    norm = candidates("rms_norm", "cpu", torch.float32)[0]
    big = dataclasses.replace(PROBLEM, seq=PROBLEM.seq * 4)  # the timing shape, not the check's

    def only_small(x, w, eps):
        if x.shape[0] > big.seq:  # the check runs one sequence, the timing the micro-batch
            raise RuntimeError("out of memory")
        return norm.fn(x, w, eps)

    first = dataclasses.replace(norm, name="first", fn=only_small)
    second = dataclasses.replace(norm, name="second", fn=only_small)
    chosen, table = measured.choose({"rms_norm": [first, second]}, big, "cpu", torch.float32)
    assert chosen == {"rms_norm": "second"}
    assert [r.verdict for r in table] == ["failed: out of memory",
                                          "chosen untimed (out of memory)"]


def test_attention_is_checked_as_the_run_calls_it():
    """The check and the timing take attention's inputs as the model hands them over (its
    (batch, seq, heads, head_dim) projections viewed as (batch, heads, seq, head_dim): strided,
    not contiguous) and at the run's own length up to ATTENTION_CHECK_SEQ (the Triton kernel's
    block sizes are autotuned per length); the row-wise ops are checked shorter. SDPA passes its
    policy on such inputs here."""
    p = dataclasses.replace(PROBLEM, seq=4096)
    assert p.for_check("attention").seq == 4096 and p.for_check("attention").batch == 1
    assert p.for_check("rms_norm").seq == measured.CHECK_SEQ
    longer = dataclasses.replace(PROBLEM, seq=4 * measured.ATTENTION_CHECK_SEQ)
    assert longer.for_check("attention").seq == measured.ATTENTION_CHECK_SEQ
    (q, k, v), _ = measured.make_inputs("attention", dataclasses.replace(PROBLEM, seq=64), "cpu",
                                        torch.float32)
    b, h, s, d = q.shape
    assert not q.is_contiguous() and q.stride() == (s * h * d, d, h * d, 1)
    assert k.stride()[1:] == (d, k.shape[1] * d, 1) and q.requires_grad and k.requires_grad
    sdpa = next(c for c in candidates("attention", "cpu", torch.float32) if c.name == "sdpa")
    assert measured.check_error(sdpa, dataclasses.replace(PROBLEM, seq=256), "cpu",
                                torch.float32) <= 1


def test_the_experts_are_measured_grouped_and_looped():
    """A mixture of experts' `auto` on a GPU: the grouped matmuls and the loop both checked
    against the fp32 reference and timed on the run's routed rows; the faster is chosen, a
    wrong one never."""
    dtype = torch.float32
    kernels = candidates("experts", "cpu", dtype)
    assert [k.name for k in kernels] == ["grouped_mm", "loop"]
    wrong = counted(kernels[0], {}, scale=1.01, name="one_percent_off")
    rows = measured.measure("experts", [wrong, *kernels], PROBLEM, "cpu", dtype)
    by_name = {r.name: r for r in rows}
    assert by_name["one_percent_off"].error > 1.0 and not by_name["one_percent_off"].chosen
    passing = [by_name["grouped_mm"], by_name["loop"]]
    assert all(r.error <= 1.0 and r.ms > 0 for r in passing)
    assert min(passing, key=lambda r: r.ms).chosen
