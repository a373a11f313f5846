"""EMA under ZeRO: equal to a reference EMA of the unpartitioned weights, invisible to training,
evaluated, and carried through save and resume."""
import pytest
import torch

from tests.conftest import launch, stopped_at, module_folder
from tests.test_train_distributed import fp32_config, records

ARGS = ["data.seq_length=64", "train.max_steps=6", "train.warmup_steps=2",
        "train.log_interval=1", "train.eval_interval=3", "train.save_interval=1",
        "train.keep_checkpoints=0", "train.eval_samples=16", "train.micro_batch_size=2",
        "train.global_batch_size=8", "logging.plot=false", "logging.tensorboard=false"]
EMA = "callbacks={ema: {enabled: true, decay: 0.6}}"


def ema_at(run, step):
    from dr_scale.export.consolidate import run_shape
    from dr_scale.callbacks.ema import load_ema_state

    return load_ema_state(run / "checkpoints" / f"step_{step:08d}", run_shape(run))


def weights_at(run, step):
    from dr_scale.export.consolidate import consolidated_state_dict, run_shape

    return consolidated_state_dict(run / "checkpoints", f"step_{step:08d}", run_shape(run))


@pytest.fixture(scope="module")
def zero3_run(request, cache_dir, tmp_path_factory):
    """Two ranks, ZeRO-3, fp32, EMA on, a checkpoint every step."""
    tmp = module_folder(request, tmp_path_factory, "ema")
    run = tmp / "z3"
    launch(["--ds_config", fp32_config(tmp, 3), "--run_dir", run, *ARGS, EMA], 2, cache_dir)
    return tmp, run


def test_zero3_ema_equals_a_reference_ema_of_the_whole_weights(zero3_run):
    """The reference: the whole (unpartitioned) weights of every step, consolidated from the
    checkpoints by DeepSpeed, averaged here."""
    from dr_scale.export.consolidate import run_shape
    from dr_scale.models import build_model

    _, run = zero3_run
    torch.manual_seed(1234)  # train.seed: the launcher's initial weights
    expected = {k: v.float().clone() for k, v in build_model(run_shape(run)).state_dict().items()}
    for step in range(1, 7):
        w = weights_at(run, step)
        for k in expected:
            expected[k].lerp_(w[k], 1 - 0.6)
    got = ema_at(run, 6)
    assert set(got) == set(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-6, msg=k)
    # And it is an average, not the last weights.
    last = weights_at(run, 6)["model.layers.0.mlp.up_proj.weight"]
    assert (got["model.layers.0.mlp.up_proj.weight"] - last).abs().max() > 1e-4


@pytest.mark.parametrize("ds", ["zero1"])  # ZeRO-3's swap is checked against the reference
def test_ema_is_invisible_to_training_and_evaluated(ds, cache_dir, tmp_path):
    plain, with_ema = tmp_path / "plain", tmp_path / "ema"
    launch(["--ds_config", ds, "--run_dir", plain, *ARGS], 2, cache_dir)
    launch(["--ds_config", ds, "--run_dir", with_ema, *ARGS, EMA], 2, cache_dir)
    a = [r for r in records(plain) if "loss" in r or "eval_loss" in r]
    b = [r for r in records(with_ema) if "loss" in r or "eval_loss" in r]
    assert [r.get("loss", r.get("eval_loss")) for r in a] == \
        [r.get("loss", r.get("eval_loss")) for r in b]  # bitwise: the swap restores exactly
    evals = [r for r in b if "eval_loss" in r]
    assert all("ema_eval_loss" in r for r in evals)
    assert evals[0]["ema_eval_loss"] == evals[0]["eval_loss"]   # step 0: EMA == weights
    assert evals[-1]["ema_eval_loss"] != evals[-1]["eval_loss"]


def test_ema_survives_save_and_resume(zero3_run, cache_dir):
    """The ZeRO-3 run stopped after its step-4 checkpoint, resumed: the EMA at step 6 equals the
    uninterrupted run's, bitwise."""
    tmp, full = zero3_run
    split = tmp / "split"
    stopped_at(full, split, 4)
    proc = launch(["--ds_config", fp32_config(tmp, 3), "--run_dir", split, "--resume"], 2,
                  cache_dir)
    assert "at step 4 (32 samples consumed)" in proc.stdout
    a, b = ema_at(full, 6), ema_at(split, 6)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_export_ema_and_bad_options(zero3_run, cache_dir, tmp_path):
    import subprocess
    import sys

    _, run = zero3_run
    out = tmp_path / "hf_ema"
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir", str(run),
                           "--out", str(out), "--ema"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(exported["model.norm.weight"], ema_at(run, 6)["model.norm.weight"])
    from tests.test_cli_errors import errors_of

    bad = launch(["--ds_config", "zero1", "--run_dir", tmp_path / "r",
                  "callbacks={ema: {enabled: true, decay: 1.5}}"], 1, cache_dir,
                 launcher="python", check=False)
    assert "callbacks.ema.decay: expected a number in [0, 1), got 1.5" in errors_of(bad)
