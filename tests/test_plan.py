"""A run is a plan, then steps: the launcher's start-up computations each run once per run
(the DeepSpeed config filled, the shape resolved, the callbacks built, the layout checked, the
resume planned), counted on a real one-rank run and its resume."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

ARGS = ["--ds_config", "zero3", "data.seq_length=64", "train.max_steps=2",
        "train.eval_samples=4", "logging.plot=false", "logging.tensorboard=false"]
ONCE = {"fill": 1, "resolve_shape": 1, "build_callbacks": 1, "refusals": 1}


def counted_run(out, *args, cache):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "count_run_steps.py"),
                           str(out), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "DR_SCALE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_each_start_up_computation_runs_once(tmp_path, cache_dir):
    run = tmp_path / "run"
    fresh = counted_run(tmp_path / "fresh.json", *ARGS, "--run_dir", run, cache=cache_dir)
    assert fresh == {"code": 0, "calls": ONCE}
    resumed = counted_run(tmp_path / "resumed.json", *ARGS, "--run_dir", run, "--resume",
                          "train.max_steps=3", cache=cache_dir)
    assert resumed == {"code": 0, "calls": {**ONCE, "reshard_plan": 1}}
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps[-1] == 3
