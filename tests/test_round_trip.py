"""The round trip as users make it, per layout: a short run at 2,048 tokens a sample, `dr-scale
export`, then `dr-scale eval`: transformers' loss on the run's own held-out samples equals the
run's last eval_loss within 1% (relative). It guards the export's names and layouts; the
position tables themselves are compared by tests/test_build_equivalence.py (a small model's
loss hardly uses fine positions)."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, launch

NARROW = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
          "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.max_seq_length=2048",
          "data.seq_length=2048", "train.micro_batch_size=1", "train.max_steps=12",
          "train.global_batch_size=4", "train.warmup_steps=2", "train.lr=1e-2",
          "train.log_interval=4",
          "train.eval_interval=12", "train.save_interval=12", "train.eval_samples=8",
          "train.eval_at_start=false", "logging.plot=false", "logging.tensorboard=false"]
# Qwen2's export (Llama's names plus q/k/v biases) is checked against transformers' logits in
# tests/test_qwen2.py; here the layouts whose export paths differ.
LAYOUTS = {
    "zero3-llama": ["--ds_config", "zero3", "model.preset=tiny"],
    "tp2-llama-untied": ["--ds_config", "zero1", "model.preset=tiny",
                         "model.tie_embeddings=false", "parallel.tensor_parallel=2"],
    # GPT-2 (as many key/value heads as query heads) from its pipeline stages' layer files
    "pp2-gpt2": ["--ds_config", "zero1", "model.preset=gpt2_tiny", "model.num_kv_heads=4",
                 "parallel.pipeline_parallel=2"],
}


def dr_scale(*args):
    return subprocess.run([sys.executable, "-m", "dr_scale.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.smoke]
                                                 if name == "zero3-llama" else [])
                                    for name in sorted(LAYOUTS)])
def test_export_scored_by_transformers_equals_the_runs_eval_loss(layout, cache_dir, tmp_path):
    run, hf = tmp_path / "run", tmp_path / "hf"
    launch(["--run_dir", run, *NARROW, *LAYOUTS[layout]], 2, cache_dir)
    exported = dr_scale("export", "--run_dir", run, "--out", hf)
    assert exported.returncode == 0, exported.stderr[-2000:]
    scored = dr_scale("eval", "--hf", hf, "--run_dir", run, "--json", "--max_rel_diff", "0.01")
    assert scored.returncode == 0, scored.stderr[-2000:]
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert result["run_step"] == evals[-1]["step"] == 12
    assert result["run_eval_loss"] == evals[-1]["eval_loss"]
    assert result["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=0.01)
    # the held-out split's samples (at most eval_samples), an even count over the 2 ranks
    assert 4 <= result["samples"] <= 8 and result["samples"] % 2 == 0
    assert result["tokens"] == result["samples"] * 2048
    print(layout, result)
    first = next(r["loss"] for r in records if "loss" in r)
    assert evals[-1]["eval_loss"] < first - 0.5  # a model that learned something


def test_eval_bad_input_is_one_line(tmp_path):
    (tmp_path / "hf").mkdir()
    proc = dr_scale("eval", "--hf", tmp_path / "hf", "--run_dir", tmp_path / "nothing")
    lines = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "metrics.jsonl: not found; --run_dir takes a run folder" in lines[0]
