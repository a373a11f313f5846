"""nan_guard on a run driven to overflow by a huge learning rate: steps skipped and named, the
run stopped after K in a row, its last good checkpoint intact and finite."""
import json
import re

import torch

from tests.conftest import launch


def test_nan_guard_skips_names_and_stops(cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero3", "--run_dir", run, "data.seq_length=64",
                   "train.lr=1e4", "train.grad_clip=0", "train.warmup_steps=0",
                   "train.max_steps=30", "train.log_interval=1", "train.save_interval=2",
                   "train.eval_interval=100", "train.eval_samples=8", "logging.plot=false",
                   "callbacks={nan_guard: {enabled: true, max_consecutive: 3}}"],
                  2, cache_dir, check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    stop = [l for l in proc.stderr.splitlines() if l.startswith("dr_scale: stopped:")]
    assert len(stop) == 1 and "nan_guard: 3 non-finite steps in a row" in stop[0]
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in recs if r.get("skipped_step")]
    assert [e["consecutive"] for e in events][-3:] == [1, 2, 3]
    assert all("first non-finite gradient: model." in e["reason"] for e in events)
    last_step = events[-1]["step"]
    # The last good checkpoint is the latest, it predates the stop, and its weights are finite.
    from dr_scale.export.consolidate import consolidated_state_dict, run_shape

    tag = (run / "checkpoints" / "latest").read_text().strip()
    assert f"last good checkpoint: {run / 'checkpoints' / tag}" in stop[0]
    assert int(tag.split("_")[1]) < last_step
    state = consolidated_state_dict(run / "checkpoints", tag, run_shape(run))
    assert all(torch.isfinite(v).all() for v in state.values())
    # DeepSpeed skipped those steps: the schedule did not advance over them.
    train = {r["step"]: r for r in recs if "loss" in r}
    assert train[last_step]["skipped_steps"] >= 3
    assert train[last_step]["lr"] == train[last_step - 1]["lr"]


def test_bad_callback_config_is_one_line(cache_dir, tmp_path):
    from tests.test_cli_errors import errors_of

    proc = launch(["--ds_config", "zero1", "--run_dir", tmp_path / "r",
                   "callbacks={nan_gaurd: {enabled: true}}"], 1, cache_dir, launcher="python",
                  check=False)
    assert re.search(r"callbacks\.nan_gaurd: unknown callback 'nan_gaurd'; known: .*nan_guard",
                     errors_of(proc))
    proc = launch(["--ds_config", "zero1", "--run_dir", tmp_path / "r",
                   "callbacks={nan_guard: {enabled: true, max_consecutive: 0}}"], 1, cache_dir,
                  launcher="python", check=False)
    assert "callbacks.nan_guard.max_consecutive: expected a value >= 1, got 0" in errors_of(proc)
