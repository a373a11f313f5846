"""A run is a plan, then steps: the launcher's start-up computations each run once per run (the
layout, the batch sizes, the DeepSpeed config filled, the shape resolved, the AutoTP section and
its divisibility check, the dataset types, the tokenizer load, the NVMe paths, the callbacks,
the refusals, the resume planned), counted on real runs; and every bad input a config can hold
is refused by the plan: exit 2 in one line, no process group started, nothing written."""
import hashlib
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, free_port

COUNT = ROOT / "tests" / "scripts" / "count_run_steps.py"
ARGS = ["--ds_config", "zero3", "data.seq_length=64", "train.max_steps=2",
        "train.eval_samples=4", "logging.plot=false", "logging.tensorboard=false"]
ONCE = {"Topology.from_config": 1, "batch_sizes": 1, "fill": 1, "resolve_shape": 1,
        "build_callbacks": 1, "refusals": 1, "fill_paths": 1, "load_tokenizer": 1,
        "init_distributed": 1}


def counted_run(out, *args, cache, ranks=1, separately=False):
    """{"code", "calls"} of a run of `ranks` rank(s) (a list of them for several, started by
    torchrun; `separately`: each rank its own process with its launcher variables and nothing
    else, so a rank's exit cannot take the others down before they report: for refusals, which
    come before any rendezvous)."""
    env = {**os.environ, "DR_SCALE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    if separately:
        procs = [subprocess.Popen([sys.executable, str(COUNT), str(out), *map(str, args)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                                 "WORLD_SIZE": str(ranks),
                                                 "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": str(free_port())})
                 for r in range(ranks)]
        stderr = "".join(p.communicate(timeout=300)[1] for p in procs)
        proc = subprocess.CompletedProcess(args, procs[0].returncode, "", stderr)
    else:
        launcher = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(free_port())]
        proc = subprocess.run([*launcher, str(COUNT), str(out), *map(str, args)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    if ranks == 1:
        return json.loads(out.read_text()), proc
    return [json.loads(out.with_name(f"{out.name}.{r}").read_text()) for r in range(ranks)], proc


def test_each_start_up_computation_runs_once(tmp_path, cache_dir):
    run = tmp_path / "run"
    fresh, proc = counted_run(tmp_path / "fresh.json", *ARGS, "--run_dir", run, cache=cache_dir)
    assert fresh == {"code": 0, "calls": ONCE}, proc.stderr[-3000:]
    resumed, proc = counted_run(tmp_path / "resumed.json", *ARGS, "--run_dir", run, "--resume",
                                "train.max_steps=3", cache=cache_dir)
    assert resumed == {"code": 0, "calls": {**ONCE, "reshard_plan": 1}}, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps[-1] == 3


def test_each_computation_runs_once_under_tensor_parallelism_with_named_data(tmp_path,
                                                                             cache_dir):
    """2 ranks, TP 2 (AutoTP's section and the divisibility check), the datasets and the
    tokenizer named in the config (their types and the tokenizer read once)."""
    from dr_scale.data.corpus import bundled_data

    tokenizer, prefix = bundled_data(cache_dir, 4096)
    ranks, proc = counted_run(tmp_path / "tp.json", *ARGS, "--run_dir", tmp_path / "run",
                              "parallel.tensor_parallel=2", f"data.tokenizer={tokenizer}",
                              f"data.datasets=[{{prefix: {prefix}}}]", cache=cache_dir, ranks=2)
    once = {**ONCE, "autotp_section": 1, "check_divisible": 1, "dataset_types": 1}
    assert ranks == [{"code": 0, "calls": once}] * 2, proc.stderr[-3000:]


def folder_digest(folder):
    """{path: sha256} of every file under `folder` ({} where it does not exist)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(result, proc, folder, before):
    """The one error line of a run the plan refused with no process group and nothing
    written."""
    assert result["code"] == 2, proc.stderr[-3000:]
    assert "init_distributed" not in result["calls"], result
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr
    assert folder_digest(folder) == before
    return lines[0]


def test_bad_inputs_are_refused_by_the_plan(tmp_path, cache_dir):
    from dr_scale.data.corpus import bundled_data

    tokenizer, _ = bundled_data(cache_dir, 4096)
    cases = [
        (["train.lr_schedule=sideways"],
         "dr_scale: error: train.lr_schedule: unknown lr schedule 'sideways'; known: "),
        ([f"data.tokenizer={tokenizer}", f"data.datasets=[{{prefix: {tmp_path / 'none'}}}]"],
         f"dr_scale: error: data.datasets[0].prefix: {tmp_path / 'none'}.bin: dataset file not "
         "found"),
        (["parallel.tensor_parallel=3"], "dr_scale: error: parallel: tensor_parallel=3 x "
         "pipeline_parallel=1 does not divide the world of 1 ranks"),
    ]
    for i, (overrides, expected) in enumerate(cases):
        run = tmp_path / f"run{i}"
        result, proc = counted_run(tmp_path / f"bad{i}.json", *ARGS, "--run_dir", run,
                                   *overrides, cache=cache_dir)
        assert refused(result, proc, run, {}).startswith(expected), proc.stderr[-2000:]
        assert not run.exists()

    # a fresh start in a folder that holds checkpoints
    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = folder_digest(run)
    result, proc = counted_run(tmp_path / "old.json", *ARGS, "--run_dir", run, cache=cache_dir)
    assert f"{run}: already holds checkpoints; pass --resume" in refused(result, proc, run, before)


def test_a_resume_with_another_tokenizer_is_refused_by_the_plan(tmp_path, cache_dir):
    run = tmp_path / "run"
    fresh, proc = counted_run(tmp_path / "fresh.json", *ARGS, "--run_dir", run,
                              "train.save_interval=2", cache=cache_dir)
    assert fresh["code"] == 0, proc.stderr[-3000:]
    before = folder_digest(run)
    result, proc = counted_run(tmp_path / "other.json", *ARGS, "--run_dir", run, "--resume",
                               "train.max_steps=3", "data.tokenizer_vocab_size=512",
                               cache=cache_dir)
    line = refused(result, proc, run, before)
    assert f"{run / 'tokenizer.model'}: the run was trained with this tokenizer, but the " \
           "resumed config gives the tokenizer trained on the bundled corpus with " \
           "data.tokenizer_vocab_size=512; token ids would change meaning" in line


def test_fewer_held_out_samples_than_data_parallel_ranks_are_refused(tmp_path, cache_dir):
    """With train.eval_samples below the data-parallel size no rank had a held-out sample and
    the held-out loss was NaN (2 ranks, eval_samples=1: {"eval_loss": NaN, "eval_tokens": 0});
    now both ranks stop in the plan, in the same line."""
    run = tmp_path / "run"
    ranks, proc = counted_run(tmp_path / "eval.json", *ARGS, "--run_dir", run,
                              "train.eval_samples=1", cache=cache_dir, ranks=2,
                              separately=True)
    assert [r["code"] for r in ranks] == [2, 2], proc.stderr[-3000:]
    assert all("init_distributed" not in r["calls"] for r in ranks)
    lines = sorted(line for line in proc.stderr.splitlines() if "dr_scale: error:" in line)
    assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[1] == "dr_scale: error: train.eval_samples=1: fewer than the 2 data-parallel " \
        "ranks, which evaluate an equal share each; expected at least 2 (a multiple of 2 uses " \
        "every sample)"
    assert lines[0].endswith(lines[1][len("dr_scale: "):]) and not run.exists()
