"""The trainer's components on their own, with no Trainer: a training record's figures
(train/step_metrics.py) and the held-out loss (train/evaluator.py), over a real one-rank gloo
group, a real model and the bundled corpus."""
import pytest
import torch
import torch.distributed as dist

from dr_scale.parallel.topology import Topology
from dr_scale.train.peak_flops import Peak
from dr_scale.train.start import RunFacts
from dr_scale.train.step_metrics import StepMetrics


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def facts(peak: Peak) -> RunFacts:
    return RunFacts(parameters=1, flops_per_token=6e6, hardware_flops_per_token=8e6, peak=peak)


def test_a_window_of_steps_gives_its_figures(one_rank_group):
    said = []
    metrics = StepMetrics(Topology(1), facts(Peak(1e12, "datasheet", "bf16", (1, 1, 1),
                                                  measured=False)), 1000, "cpu", said.append)
    rec = metrics.window(10, [torch.tensor(2.0), torch.tensor(4.0)], 0.5)
    mem = rec.pop("mem_peak_bytes")
    assert mem > 0
    # 2 steps x 1000 tokens in 0.5 s: 4000 tokens/s; x 6e6 FLOPs = 0.024 TFLOP/s of a 1 TFLOP/s peak
    assert rec == pytest.approx({"step": 10, "loss": 3.0, "tokens_per_s": 4000.0, "tflops": 0.024,
                                 "mfu": 0.024, "hfu": 0.032, "peak_tflops": 1.0,
                                 "step_time_s": 0.25}, rel=1e-12)
    assert said == []


def test_an_impossible_utilisation_is_never_printed(one_rank_group):
    said = []
    metrics = StepMetrics(Topology(1), facts(Peak(1e9, "datasheet", "bf16", (1, 1, 1),
                                                  measured=False)), 1000, "cpu", said.append)
    rec = metrics.window(5, [torch.tensor(1.0)], 1.0)  # HFU 8 (800%) against a datasheet peak
    assert "mfu" not in rec and "hfu" not in rec and rec["tflops"] == pytest.approx(6e-3)
    assert said == ["MFU not reported from step 5 on: above 100% even after measuring the peak "
                    "again (datasheet)"]
    assert "mfu" not in metrics.window(6, [torch.tensor(1.0)], 1000.0)  # stays unreliable
    assert len(said) == 1


def test_a_measured_peak_too_low_is_measured_again(one_rank_group, tmp_path, monkeypatch):
    monkeypatch.setenv("DR_SCALE_CACHE", str(tmp_path))
    said = []
    peak = Peak(1.0, "measured fp32 matmul 64x64x64", "fp32", (64, 64, 64))  # 1 FLOP/s: too low
    metrics = StepMetrics(Topology(1), facts(peak), 10, "cpu", said.append)
    rec = metrics.window(3, [torch.tensor(1.0)], 1.0)
    assert peak.remeasured and peak.value > 1e6
    assert rec["mfu"] == pytest.approx(60e6 / peak.value) and rec["hfu"] <= 1.0
    assert said[0].startswith("peak (MFU's denominator) measured again at step 3: ")


def test_the_held_out_loss_is_the_mean_token_loss_of_the_held_out_samples(one_rank_group,
                                                                         cache_dir):
    from dr_scale.config import load_config
    from dr_scale.data.documents import DocumentBoundaries
    from dr_scale.data.loader import build_sources, resolve_files
    from dr_scale.models import build_model, resolve_shape
    from dr_scale.train.evaluator import Evaluator
    from dr_scale.train.step_runner import PlainSteps, StepHooks

    cfg = load_config(None, ["data.seq_length=64", f"data.cache_dir={cache_dir}"])
    tokenizer, specs = resolve_files(cfg.data)
    sources = build_sources(cfg.data, 0, 8, 6, tokenizer, specs)
    torch.manual_seed(0)
    model = build_model(resolve_shape(cfg.model, sources.tokenizer.vocab_size))
    steps = PlainSteps(model, torch.device("cpu"), 1,
                       DocumentBoundaries.of(cfg.data, sources.tokenizer), StepHooks.quiet())
    loss, tokens = Evaluator(model, sources.valid, 4, Topology(1), torch.device("cpu"),
                             steps).loss()
    samples = torch.stack([sources.valid[i] for i in range(len(sources.valid))])
    assert len(samples) == 6 and tokens == 6 * 64
    with torch.no_grad():
        expected = model(samples[:, :-1], samples[:, 1:]).item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert model.training  # evaluation leaves the model training
