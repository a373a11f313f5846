"""One model, however it is built: for every family in fp32 and bf16, each way a run builds it
(ZeRO-3 sharded on 1 and 2 ranks with the bundled zero3, on meta and made real under TP 2 and
PP 2 (the mixture of experts, here the DeepSeek-style family, has no pipeline), model.init_from a transformers folder, resume from a checkpoint, compiled blocks) gives the engine the
buffers a plain build makes, exactly, and the same logits on one input of the model's full
length (4,096 tokens; GPT-2 1,024): bitwise where the arithmetic is the same, within a stated
tolerance under tensor parallelism and compiled blocks, where the sums run in another order. No random draw meets a
generator on another device, nor runs while DeepSpeed's zero.Init rewrites the constructors."""
import json

import pytest

from tests.conftest import run_rank_script

# Tensor parallelism sums each projection's halves separately: the largest logit difference,
# relative to the largest logit, within 1e-5 in fp32 and one bf16 rounding step (2^-7) in bf16.
TP_TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 2 ** -7}
FAMILIES = ("llama", "qwen2", "gpt2", "glm4_moe")
# the rotary tables; the DeepSeek-style family's routing bias in its one MoE block of two
BUFFERS = {"llama": 2, "qwen2": 2, "gpt2": 0, "glm4_moe": 3}
EXPECTED = {
    "zero3x1": {f"{f}/{p}{extra}" for f in FAMILIES for p in ("fp32", "bf16")
                for extra in ("", "/init_from")},
    "zero3x2": {f"{f}/{p}{extra}" for f in FAMILIES for p in ("fp32", "bf16")
                for extra in ("", "/resume")} | {"llama/fp32/compiled"},
    "tp2": {f"{f}/{p}" for f in FAMILIES for p in ("fp32", "bf16")},
    # mixture of experts: refused under pipeline parallelism
    "pp2": {f"{f}/{p}" for f in ("llama", "qwen2", "gpt2") for p in ("fp32", "bf16")},
}
RANKS = {"zero3x1": 1, "zero3x2": 2, "tp2": 2, "pp2": 2}


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_every_build_path_gives_the_plain_models_buffers_and_logits(layout, tmp_path):
    run_rank_script("build_equivalence.py", tmp_path / "result", layout)
    logits_seen = set()
    for rank in range(RANKS[layout]):
        result = json.loads((tmp_path / f"result.{rank}").read_text())
        assert set(result) == EXPECTED[layout]
        for case, r in result.items():
            family = case.split("/")[0]
            assert r["tokens"] == (1024 if family == "gpt2" else 4096), case
            # buffers: the same dtype (fp32) and values as the plain build's, every one of them
            assert len(r["buffers"]) == BUFFERS[family], case
            for name, b in r["buffers"].items():
                assert b["equal"] and b["dtype"] == "torch.float32", (case, name, b)
            for draw in r.get("draws", []):
                assert draw["tensor"] == draw["generator"], (case, draw)
                assert not draw["inside_zero_init"], (case, draw)
            if "bitwise" not in r:  # a pipeline's first stage has no logits
                continue
            logits_seen.add(case)
            assert r["dtype"] == ("torch.bfloat16" if "/bf16" in case else "torch.float32")
            if layout == "tp2" or case.endswith("/compiled"):
                # (compiled: inductor fuses the norms and the MLP and sums in its own order)
                # a mixture of experts routes a token whose top-k is a near tie by the rounding:
                # in bf16 some positions change experts, so 99% of positions must be within
                diff = r["p99_diff"] if case == "glm4_moe/bf16" else r["max_diff"]
                assert diff <= TP_TOLERANCE[r["dtype"]] * r["scale"], (case, r)
            else:
                assert r["bitwise"], (case, r["max_diff"])
            assert r["scale"] > 0.1, case  # logits that say something
    assert logits_seen == EXPECTED[layout]  # every case compared its logits on some rank
