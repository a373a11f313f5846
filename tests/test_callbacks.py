"""Callbacks: typed options named `callbacks.<name>.<key>`, refusals declared by the callback,
and checkpointed state keyed by name (resume with a callback added or removed)."""
import pytest
import torch

from dr_scale.callbacks.base import Callback, CallbackList
from dr_scale.callbacks.build import build_callbacks
from dr_scale.errors import DrScaleError
from dr_scale.parallel.topology import Topology
from tests.conftest import launch
from tests.test_ema import ARGS, ema_at, weights_at
from tests.test_train_distributed import fp32_config


class Counter(Callback):
    name = "counter"

    def __init__(self, start=0):
        self.count = start

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class Tally(Counter):
    name = "tally"


def test_state_goes_to_the_callback_of_its_name():
    saved = CallbackList([Counter(3), Tally(7)]).state_dict()
    assert saved == {"counter": {"count": 3}, "tally": {"count": 7}}
    lines = []
    only_tally = CallbackList([Tally()])  # counter removed: its state is named, never handed on
    only_tally.load_state_dict(saved, None, lines.append)
    assert only_tally.callbacks[0].count == 7
    assert lines == ["callbacks.counter: state in the checkpoint, but the callback is not "
                     "enabled now: its state is not used"]
    lines = []
    more = CallbackList([Counter(), Tally(), _Fresh()])  # one added: it starts fresh
    more.load_state_dict({"tally": {"count": 7}}, None, lines.append)
    assert [cb.count for cb in more.callbacks[:2]] == [0, 7] and more.callbacks[2].fresh
    assert lines == ["callbacks.counter: no state in the checkpoint (enabled after it was "
                     "written): starts fresh",
                     "callbacks.fresh: no state in the checkpoint (enabled after it was "
                     "written): starts fresh"]


class _Fresh(Callback):
    name = "fresh"
    fresh = False

    def on_missing_state(self, trainer):
        self.fresh = True


def test_two_callbacks_of_one_name_are_refused():
    with pytest.raises(DrScaleError, match="a callback named 'counter' is already registered"):
        CallbackList([Counter(), Counter()])


@pytest.mark.parametrize("cfg, message", [
    ({"ema": {"enabled": True, "decay": "high"}}, "callbacks.ema.decay: expected a number, got 'high'"),
    ({"ema": {"enabled": True, "decay": 1.0}}, r"callbacks.ema.decay: expected a number in \[0, 1\)"),
    ({"ema": {"enabled": True, "decy": 0.9}}, "callbacks.ema.decy: unknown key \\(did you mean "
                                               "'callbacks.ema.decay'\\?\\)"),
    ({"per_layer_clip": {"enabled": False, "max_norm": -1}},  # checked even when switched off
     "callbacks.per_layer_clip.max_norm: expected a value >= 1e-12, got -1.0"),
    ({"step_profiler": {"enabled": True, "ranks": "0"}},
     "callbacks.step_profiler.ranks: expected a list of an integer, got '0'"),
    ({"memory_alert": {"enabled": True, "max_usage": "lots"}},
     "callbacks.memory_alert.max_usage: expected a percentage"),
    ({"nan_guard": {"enabled": True, "max_consecutive": 0}},
     "callbacks.nan_guard.max_consecutive: expected a value >= 1, got 0"),
])
def test_bad_options_are_one_line_naming_the_key(cfg, message):
    with pytest.raises(DrScaleError, match=message) as e:
        build_callbacks(cfg)
    assert "\n" not in str(e.value)


def test_pipeline_refusals_come_from_the_callbacks():
    on = {"enabled": True}
    names = [cb.name for cb in build_callbacks({n: on for n in (
        "ema", "per_layer_clip", "grad_norm_monitor", "nan_guard", "memory_monitor")})]
    assert names == ["grad_norm_monitor", "ema", "per_layer_clip", "nan_guard", "memory_monitor"]
    for name, why in [("ema", "it keeps the model's parameters by name"),
                      ("per_layer_clip", "it acts between backward and the optimizer step"),
                      ("grad_norm_monitor", "it acts between backward and the optimizer step")]:
        with pytest.raises(DrScaleError, match=f"callbacks.{name}: not available with "
                                               f"parallel.pipeline_parallel=2 \\({why}"):
            build_callbacks({name: on}, Topology(2, pipeline=2))
    assert len(build_callbacks({"nan_guard": on, "memory_monitor": on}, Topology(2, pipeline=2))) == 2


def test_resume_with_a_callback_added_and_one_removed(cache_dir, tmp_path):
    """Saved with nan_guard, resumed with EMA instead: nan_guard's state is named and left, the
    new EMA starts from the resumed weights (so after one more step it is the average of the
    step-4 and step-5 weights), and nothing is handed to the wrong callback."""
    ds = fp32_config(tmp_path, 1)
    run = tmp_path / "run"
    launch(["--ds_config", ds, "--run_dir", run, *ARGS, "train.max_steps=5",
            "callbacks={nan_guard: {enabled: true}}", "--stop_at_step", 4], 1, cache_dir)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume",
                   "callbacks.nan_guard.enabled=false",
                   "callbacks.ema={enabled: true, decay: 0.6}"], 1, cache_dir)
    assert ("callbacks.nan_guard: state in the checkpoint, but the callback is not enabled now: "
            "its state is not used") in proc.stdout
    assert ("callbacks.ema: no state in the checkpoint (enabled after it was written): starts "
            "fresh") in proc.stdout
    w4, w5, ema = weights_at(run, 4), weights_at(run, 5), ema_at(run, 5)
    assert set(ema) == set(w5)
    for name in w5:
        torch.testing.assert_close(ema[name], 0.6 * w4[name] + 0.4 * w5[name], atol=1e-6,
                                   rtol=1e-6, msg=name)
