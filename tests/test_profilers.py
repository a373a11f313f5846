"""Profilers and monitors of the compatibility layer: the data-loader profiler's stage times,
the non-finite output tracer, and all of them switched on from the YAML in one ZeRO-3 run."""
import json
import time

import pytest
import torch

from dr_scale.callbacks.dataloader_profiler import DataLoaderProfiler
from dr_scale.callbacks.nan_guard import NonFiniteOutputs
from tests.conftest import launch

SLEEP_S = 0.004


class SlowDataset(torch.utils.data.Dataset):
    """Each sample takes SLEEP_S to read: the fetch time the profiler must find."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(SLEEP_S)
        return torch.full((8,), i)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_profiler_times_each_stage(workers):
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4, num_workers=workers)
    seen = []
    with DataLoaderProfiler("cpu") as prof:
        for batch in prof.wrap(loader):
            seen.append(batch)
            time.sleep(0.01)  # the training step the workers overlap with
    assert torch.equal(torch.cat(seen), torch.cat(list(loader)))  # same batches, same order
    st = prof.stats()
    # Invariants that hold on a machine of any speed or load (no wall-clock ratios): every
    # sample's sleep is counted as fetch time, wherever it ran; the loop's own 10 ms per batch is
    # never counted as waiting for data.
    assert st["batches"] == 16
    assert st["fetch_s"] >= 64 * SLEEP_S and st["collate_s"] > 0
    assert st["wait_s"] + st["h2d_s"] <= st["wall_s"] - 16 * 0.01
    assert 0 <= st["loop_share_lost"] <= 1
    if workers == 0:  # in-process: the loop waits for every fetch and collate
        assert st["wait_s"] >= st["fetch_s"] + st["collate_s"]
    table = prof.summary()
    assert table.splitlines()[0].split()[:2] == ["stage", "total"]
    assert "16 batches" in table


def test_nonfinite_outputs_names_the_module_where_it_began():
    from tests.test_models import shape_of
    from dr_scale.models import build_model

    model = build_model(shape_of("model.preset=tiny", vocab=64))
    tracer = NonFiniteOutputs(model, "cpu")
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens)
    assert tracer.first() is None and tracer.flags.sum() == 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    model(tokens)
    assert tracer.first() == "model.layers.1.mlp.down_proj"
    tracer.remove()


def test_compat_callbacks_in_a_zero3_run(cache_dir, tmp_path):
    run = tmp_path / "run"
    launch(["--ds_config", "zero3", "--run_dir", run, "data.seq_length=64",
            "train.max_steps=6", "train.log_interval=2", "train.eval_interval=6",
            "train.save_interval=6", "train.eval_samples=8", "logging.plot=false",
            "train.grad_clip=1.0",
            "callbacks={per_layer_clip: {enabled: true, max_norm: 0.02}, "
            "grad_norm_monitor: {enabled: true, top_k: 3}, dataloader_profiler: {enabled: true}, "
            "step_profiler: {enabled: true, start_step: 2, steps: 2}}"], 2, cache_dir)
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for r in train:
        assert r["clipped_params"] > 0
        # DeepSpeed's own norm is taken after the per-layer clip, the monitor's before it.
        assert 0 < r["grad_norm"] < r["grad_norm_total"]
        top = r["grad_norm_top"]
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert top[0][1] <= r["grad_norm_total"]
        assert r["data_wait_ms"] >= 0
    profile = json.loads((run / "dataloader_profile.json").read_text())
    assert profile["batches"] == 6 and profile["fetch_s"] > 0
    traces = sorted((run / "profiles").glob("*.trace.json"))
    assert [t.name for t in traces] == ["steps_000003-000004_rank0.trace.json"]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"dr_scale.forward", "dr_scale.backward", "dr_scale.optimizer_step"} <= names
    assert "self cpu" in (run / "profiles" / "steps_000003-000004_rank0.txt").read_text().lower()
    ops = json.loads((run / "profiles" / "steps_000003-000004_rank0.ops.json").read_text())
    assert ops["steps"] == 2 and ops["device"] is False
    gemms = [op for name, op in ops["operators"].items() if name in ("aten::mm", "aten::addmm")]
    assert gemms and all(op["self_ms"] > 0 and op["calls"] >= 1 for op in gemms)
