"""Sharded construction. Under ZeRO-3: on 2 gloo ranks, each holds half of every parameter as
it is built, and the gathered values equal an unsharded build's from the same seed (so the
initialisation keeps its distribution exactly), fp32 and bf16, with and without biases; and a
Hugging Face folder loaded into it (model.init_from) gives each rank the file's values. Under
tensor and pipeline parallelism: built on meta, each rank makes real only its slices or its
stage, equal to DeepSpeed's split of the whole model built from the same seed, and a
row-parallel slice draws only its own columns' values."""
import json
import math

from tests.conftest import run_rank_script


def rank_results(script: str, tmp_path) -> list:
    """Each of the 2 ranks' results of tests/scripts/<script>."""
    run_rank_script(script, tmp_path / "result")
    return [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in (0, 1)]


def test_zero3_builds_each_rank_its_shard_with_the_unsharded_values(tmp_path):
    for result in rank_results("sharded_build.py", tmp_path):
        assert sorted(result) == ["gpt2_tiny/fp32", "tiny/bf16", "tiny/fp32"]
        for case, r in result.items():
            assert r["total"] == r["plain_total"] > 1_000_000, case
            assert r["groups"][0] == r["groups"][1] and r["groups"][0][0] > 0, case
            # each rank holds its half (ZeRO pads a tensor to a multiple of the ranks)
            assert r["total"] / 2 <= r["held"] <= r["total"] / 2 + len(r["params"]), case
            dtype = "torch.bfloat16" if case.endswith("bf16") else "torch.float32"
            for name, p in r["params"].items():
                assert p["placeholder"] == 0, (case, name)  # nothing whole left behind
                assert p["dtype"] == dtype, (case, name)
                assert p["equal"], (case, name)
                assert r["loaded"][name], (case, name)
                assert p["mean"] == p["ref_mean"] and p["std"] == p["ref_std"], (case, name)
        # the distribution itself: std 0.02 for matrices, 0.02/sqrt(2L) for residual outputs
        tiny = result["tiny/fp32"]["params"]
        assert math.isclose(tiny["model.layers.0.self_attn.q_proj.weight"]["std"], 0.02,
                            rel_tol=0.02)
        assert math.isclose(tiny["model.layers.0.mlp.down_proj.weight"]["std"],
                            0.02 / math.sqrt(2 * 4), rel_tol=0.02)
        assert tiny["model.norm.weight"]["mean"] == 1.0


def test_tensor_and_pipeline_parallel_make_real_only_this_ranks_part(tmp_path):
    for result in rank_results("sharded_build_tp_pp.py", tmp_path):
        assert sorted(result) == ["gpt2_tiny/tp2", "tiny/pp2", "tiny/tp2"]
        for case, r in result.items():
            assert r["built_meta"], case
            # every parameter this rank keeps is real and equal to DeepSpeed's split of the
            # whole model from the same seed (so each keeps today's distribution exactly)
            assert len(r["params"]) > 15, case
            for name, p in r["params"].items():
                assert p["equal"] and not p["meta"], (case, name)
            if case.endswith("tp2"):  # every tensor made, as this rank's slice only
                assert r["made"] == r["held"] and r["left_on_meta"] == 0, case
                # a row-parallel slice (a matrix, its columns cut) draws only its columns' tiles
                cut = {n: p for n, p in r["params"].items()
                       if p["columns_cut"] and len(p["shape"]) == 2}
                assert len(cut) >= 8, case  # o_proj and down_proj of 4 layers at least
                for name, p in cut.items():
                    assert p["drawn"] == p["numel"], (case, name)
                # the matrices are halved, the norms (and GPT-2's row-parallel biases) whole
                assert r["total"] / 2 <= r["held"] < 0.55 * r["total"], case
                assert all(r["loaded"].values()) and len(r["loaded"]) == len(r["params"]), case
            else:  # this stage made; the other stage's layers stay on meta
                assert r["held"] + r["left_on_meta"] == r["total"], case
                assert r["held"] < 0.7 * r["total"] and r["left_on_meta"] > 0.3 * r["total"]
        tiny = result["tiny/tp2"]["whole_stats"]
        assert math.isclose(tiny["model.layers.0.self_attn.q_proj.weight"][1], 0.02, rel_tol=0.02)
        assert math.isclose(tiny["model.layers.0.mlp.down_proj.weight"][1],
                            0.02 / math.sqrt(2 * 4), rel_tol=0.02)
        assert tiny["model.norm.weight"] == [1.0, 0.0]
