"""A checkpoint written by N ranks resumes on M ranks (and at another ZeRO stage), the loss
going on as in the uninterrupted run; combinations DeepSpeed cannot reshard stop with one line."""
import json
import subprocess
import sys

import pytest

from tests.conftest import launch, stopped_at, module_folder
from tests.test_train_distributed import records

ARGS = ["data.seq_length=64", "train.max_steps=8", "train.warmup_steps=2",
        "train.log_interval=1", "train.eval_interval=8", "train.save_interval=4",
        "train.eval_samples=16", "train.micro_batch_size=2", "train.global_batch_size=8",
        "logging.plot=false", "logging.tensorboard=false"]


# The layout changes in fp32: 6 steps, a checkpoint at step 3, steps 4-6 compared
FP32_ARGS = [a for a in ARGS if not a.startswith(("train.max_steps", "train.save_interval",
                                                  "train.eval_interval"))] + [
    "train.max_steps=6", "train.save_interval=3", "train.eval_interval=6"]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(request, cache_dir, tmp_path_factory):
    """One 8-step run per (ranks, ZeRO config), shared by the cases that save with it; its
    step-4 checkpoint is where they resume from."""
    runs = {}

    def get(ranks, ds):
        if (ranks, ds) not in runs:
            run = module_folder(request, tmp_path_factory, f"full_{ranks}_{ds}") / "run"
            launch(["--ds_config", ds, "--run_dir", run, *ARGS], ranks, cache_dir)
            runs[ranks, ds] = run
        return runs[ranks, ds]
    return get


# fewer ranks in bf16 (the layout changes below run in fp32, ZeRO-1 <-> ZeRO-3 among them)
@pytest.mark.parametrize("save, resume", [((2, "zero3"), (1, "zero3"))])
def test_resume_on_another_number_of_ranks(save, resume, uninterrupted, cache_dir, tmp_path):
    (save_ranks, save_ds), (resume_ranks, resume_ds) = save, resume
    full = uninterrupted(save_ranks, save_ds)
    run = tmp_path / "run"
    stopped_at(full, run, 4)
    proc = launch(["--ds_config", resume_ds, "--run_dir", run, "--resume",
                   "train.keep_checkpoints=1"], resume_ranks, cache_dir)
    assert "resharding" in proc.stdout and "at step 4 (32 samples consumed)" in proc.stdout
    # the step-4 checkpoint went at step 8's save, and the universal form made from it with it
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_00000008", "universal"]
    assert not list(ckpt.glob("universal/*/step_00000004"))
    a, b = losses(full), losses(run)
    assert sorted(b) == list(range(1, 9))
    for step in range(5, 9):  # same data and weights, other reduction order and sharding
        assert b[step] == pytest.approx(a[step], rel=1e-3), step
    assert b[8] < b[1]


@pytest.fixture(scope="module")
def fp32_uninterrupted(request, cache_dir, tmp_path_factory):
    """8-step fp32 runs by layout (ranks, sizes, ZeRO stage), shared by the layout-change
    cases."""
    from tests.test_train_distributed import fp32_config

    tmp = module_folder(request, tmp_path_factory, "fp32")
    configs, runs = {stage: fp32_config(tmp, stage) for stage in (1, 3)}, {}

    def get(layout: str, preset: str = "tiny"):
        if (layout, preset) not in runs:
            runs[layout, preset] = tmp / f"full_{layout}_{preset}"
            ranks, sizes, stage = LAYOUTS[layout]
            launch(["--ds_config", configs[stage], "--run_dir", runs[layout, preset], *FP32_ARGS,
                    f"model.preset={preset}", *sizes], ranks, cache_dir)
        return runs[layout, preset]
    get.configs = configs
    return get


TP2, PP2 = "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"
LAYOUTS = {"dp2": (2, [], 1), "tp2": (2, [TP2], 1), "pp2": (2, [PP2], 1),
           "tp2pp2": (4, [TP2, PP2], 1), "dp4": (4, [], 1), "dp2tp2_zero3": (4, [TP2], 3)}


def resume_on_another_layout(full, layout, run, cache_dir, configs, converted_ahead=False):
    """`run` as stopped after step 3 of `full`, resumed on `layout`: the largest relative
    difference from `full`'s losses over steps 4-6."""
    ranks, sizes, stage = LAYOUTS[layout]
    proc = launch(["--ds_config", configs[stage], "--run_dir", run, "--resume",
                   "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1", *sizes], ranks,
                  cache_dir)
    assert ("resharding" in proc.stdout) is not converted_ahead
    assert "at step 3 (24 samples consumed)" in proc.stdout
    expected = {"dp2": "DP 2 x TP 1 x PP 1", "tp2": "DP 1 x TP 2 x PP 1",
                "pp2": "DP 1 x TP 1 x PP 2", "tp2pp2": "DP 1 x TP 2 x PP 2",
                "dp4": "DP 4 x TP 1 x PP 1", "dp2tp2_zero3": "DP 2 x TP 2 x PP 1"}[layout]
    assert expected in proc.stdout and f"ZeRO-{stage}, fp32" in proc.stdout
    a, b = losses(full), losses(run)
    assert sorted(b) == list(range(1, 7))
    return max(abs(b[s] - a[s]) / a[s] for s in range(4, 7))


# Each direction of each kind of change at least once: TP and PP together to and from DP,
# TP <-> PP, ZeRO-3 with TP to and from ZeRO-1 on other ranks, a pipeline to ZeRO-3 with TP.
# TP 2 -> DP 2 (the control below, and Qwen2) and PP 2 -> DP 2 (GPT-2) run in the tests after.
@pytest.mark.parametrize("source, target", [
    ("tp2pp2", "dp2"), ("dp2", "tp2pp2"), ("tp2", "pp2"), ("pp2", "tp2"),
    ("dp2tp2_zero3", "dp4"), ("dp4", "dp2tp2_zero3"), ("tp2pp2", "dp2tp2_zero3")])
def test_layout_changes_continue_the_uninterrupted_run(source, target, fp32_uninterrupted,
                                                       cache_dir, tmp_path):
    """TP 2 x PP 2 (4 ranks) <-> DP 2 and TP 2 <-> PP 2 at ZeRO-1; DP 2 x TP 2 at ZeRO-3 <-> DP 4
    at ZeRO-1, and TP 2 x PP 2 at ZeRO-1 -> DP 2 x TP 2 at ZeRO-3; in fp32, each against the
    target layout's uninterrupted run: through DeepSpeed's universal form (a tensor-parallel
    checkpoint's slices joined by the AutoTP record it keeps, and cut again by the target's; a
    pipeline's parameters renamed from layer indices to the model's names and back); steps 4-6
    continue within 1e-5 relative (the global batch the same, the reduction order not)."""
    run = tmp_path / "run"
    stopped_at(fp32_uninterrupted(source), run, 3)
    apart = resume_on_another_layout(fp32_uninterrupted(target), target, run, cache_dir,
                                     fp32_uninterrupted.configs)
    print(f"{source} -> {target}: steps 4-6 at most {apart:.1e} relative from the "
          "uninterrupted run's")
    assert apart <= 1e-5


@pytest.mark.parametrize("preset, source", [("gpt2_tiny", "pp2"), ("qwen2_tiny", "tp2")])
def test_each_family_changes_layout(preset, source, fp32_uninterrupted, cache_dir, tmp_path):
    """GPT-2 (learned positions in the pipeline's tied embedding layer) and Qwen2 (q/k/v biases
    sliced with their columns) to DP 2, against the source layout's uninterrupted run (the same
    arithmetic as DP 2's to within 1e-5: tests/test_parallel.py, tests/test_qwen2.py)."""
    run = tmp_path / "run"
    full = fp32_uninterrupted(source, preset)
    stopped_at(full, run, 3)
    apart = resume_on_another_layout(full, "dp2", run, cache_dir, fp32_uninterrupted.configs)
    print(f"{preset} {source} -> dp2: steps 4-6 at most {apart:.1e} relative")
    assert apart <= 1e-5


def test_a_layout_change_without_the_optimizer_state_misses(fp32_uninterrupted, cache_dir,
                                                            tmp_path):
    """The control of the test above: TP 2 -> DP 2 converted ahead of the job, Adam's moments
    then zeroed in the converted form, misses the uninterrupted losses by far more than 1e-5
    (the learning rate at steps 4-6 is 0.87, 0.55, 0.23 of its peak): the comparison sees the
    optimizer state."""
    import torch

    run = tmp_path / "run"
    stopped_at(fp32_uninterrupted("tp2"), run, 3)
    subprocess.run([sys.executable, "-m", "dr_scale.cli", "reshard", "--run_dir", str(run),
                    "--to", "dp=2 tp=1"], check=True, capture_output=True, timeout=300)
    moments = list((run / "checkpoints" / "universal").rglob("exp_avg*.pt"))
    assert len(moments) > 20
    for f in moments:
        state = torch.load(f, weights_only=False)
        state["param"].zero_()
        torch.save(state, f)
    apart = resume_on_another_layout(fp32_uninterrupted("dp2"), "dp2", run, cache_dir,
                                     fp32_uninterrupted.configs, converted_ahead=True)
    print(f"tp2 -> dp2 with Adam's moments zeroed: steps 4-6 at most {apart:.1e} relative")
    assert apart > 1e-3


def test_reshard_ahead_of_the_job_with_parallel_workers(uninterrupted, cache_dir, tmp_path):
    """`dr-scale reshard` converts before any job: 1 worker and 2 write the same bytes, and the
    resumed run loads the result without converting again."""
    full = uninterrupted(2, "zero3")
    runs = {w: tmp_path / f"w{w}" / "run" for w in (1, 2)}
    for workers, run in runs.items():
        stopped_at(full, run, 4)
        proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "reshard", "--run_dir",
                               str(run), "--ranks", "1", "--workers", str(workers)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"with {workers} worker(s)" in proc.stdout
        assert "universal/zero3-1ranks/step_00000004 in " in proc.stdout
    made = {w: run / "checkpoints" / "universal" / "zero3-1ranks" / "step_00000004"
            for w, run in runs.items()}
    files = sorted(p.relative_to(made[1]) for p in made[1].rglob("*") if p.is_file())
    assert len(files) > 20
    assert files == sorted(p.relative_to(made[2]) for p in made[2].rglob("*") if p.is_file())
    for f in files:
        assert (made[1] / f).read_bytes() == (made[2] / f).read_bytes(), f
    proc = launch(["--ds_config", "zero3", "--run_dir", runs[2], "--resume"], 1, cache_dir)
    assert "resharding" not in proc.stdout and "at step 4 (32 samples consumed)" in proc.stdout
    a, b = losses(full), losses(runs[2])
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-3), step


def test_resume_with_another_sub_group_size_goes_through_the_universal_form(uninterrupted,
                                                                           cache_dir, tmp_path):
    """ZeRO-3 lays its optimizer state out in sub-groups of zero_optimization.sub_group_size, and
    DeepSpeed loads another layout only from the universal form (directly it stops: "loaded
    state dict contains a parameter group that doesn't match the size of optimizer's group"). A
    resume on the same ranks with another size converts, and the losses are the uninterrupted
    run's bit for bit (the sub-grouping alone changes no bit). Before checkpoint/universal.py's
    `repair_zero3_load` they drifted from step 6 on (6.4661 against 6.4651, 6.0426 against
    6.0284 at step 8): DeepSpeed's universal load shared one Adam step tensor among the
    sub-groups and gave the no-decay group the first group's weight decay."""
    from dr_scale.config import ds_config as dsc

    full = uninterrupted(2, "zero3")
    run = tmp_path / "run"
    stopped_at(full, run, 4)
    ds = dsc.read_json(dsc.resolve_path("zero3"))
    ds["zero_optimization"]["sub_group_size"] = 100_000  # the 2M-parameter partition in ~20
    config = tmp_path / "zero3_small_sub_groups.json"
    config.write_text(json.dumps(ds))
    proc = launch(["--ds_config", config, "--run_dir", run, "--resume"], 2, cache_dir)
    assert "resharding" in proc.stdout and "at step 4 (32 samples consumed)" in proc.stdout
    a, b = losses(full), losses(run)
    assert sorted(b) == list(range(1, 9))
    assert [b[step] for step in range(5, 9)] == [a[step] for step in range(5, 9)]


def test_nvme_optimizer_state_is_not_resharded(uninterrupted, tmp_path):
    """DeepSpeed's universal checkpoint cannot carry ZeRO-Infinity's swapped optimizer state
    either way (checkpoint/reshard.py): a run with its state on NVMe resumes on its own ranks, and
    another number of ranks is one line naming the way out, before any conversion starts."""
    from dr_scale.errors import DrScaleError
    from dr_scale.checkpoint.layout import TargetLayout
    from dr_scale.checkpoint.reshard import reshard_plan

    run = tmp_path / "run"
    stopped_at(uninterrupted(2, "zero3"), run, 4)
    ckpt = run / "checkpoints"
    assert reshard_plan(ckpt, "step_00000004", TargetLayout(2, 3), target_nvme=True) == "direct"
    with pytest.raises(DrScaleError, match="resumed with 100000 and optimizer state on NVMe"):
        reshard_plan(ckpt, "step_00000004", TargetLayout(2, 3), target_nvme=True,
                     sub_group_size=100_000)
    with pytest.raises(DrScaleError, match="resuming on 1 needs DeepSpeed's universal checkpoint, "
                                           "which it cannot load into optimizer state on NVMe"):
        reshard_plan(ckpt, "step_00000004", TargetLayout(1, 3), target_nvme=True)
    # written with its state on NVMe: DeepSpeed copies the swap files into the checkpoint here
    (ckpt / "step_00000004" / "offloaded_tensors" / "rank00").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "dr_scale.cli", "reshard", "--run_dir", str(run),
                           "--ranks", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "its optimizer state is on NVMe" in proc.stderr and "model.init_from" in proc.stderr
    assert not (ckpt / "universal").exists()


def test_zero0_to_zero1_is_refused_with_what_to_do(cache_dir, tmp_path):
    run = tmp_path / "run"
    launch(["--ds_config", "zero0", "--run_dir", run, *ARGS, "--stop_at_step", 4], 2, cache_dir)
    proc = launch(["--ds_config", "zero1", "--run_dir", run, "--resume"], 1, cache_dir,
                  check=False)
    assert proc.returncode == 2
    assert ("a ZeRO-0 checkpoint (2 rank(s)) cannot be resumed at ZeRO-1: ZeRO-0 keeps no "
            "partitioned optimizer state to reshard") in proc.stderr


def test_data_continues_at_the_next_sample_when_the_data_parallel_size_changes(cache_dir,
                                                                               tmp_path):
    """With the default global batch (micro x data-parallel ranks) the global batch changes with
    the ranks: 1 rank for 2 steps (2 samples each), resumed on 2 ranks for 2 steps (4 each), then
    on 1 rank again. The data position is the samples consumed, so each leg starts at the exact
    next sample (it used to be step x the new global batch: samples skipped)."""
    args = ["data.seq_length=32", "train.max_steps=6", "train.warmup_steps=1",
            "train.log_interval=1", "train.eval_interval=100", "train.save_interval=100",
            "train.eval_samples=4", "train.micro_batch_size=2", "train.eval_at_start=false",
            "logging.plot=false", "logging.tensorboard=false"]
    run = tmp_path / "run"
    launch(["--ds_config", "zero1", "--run_dir", run, *args, "--stop_at_step", "2"], 1, cache_dir)
    proc = launch(["--ds_config", "zero1", "--run_dir", run, "--resume", "--stop_at_step", "4"],
                  2, cache_dir)
    assert "at step 2 (4 samples consumed; global batch 2 -> 4 samples" in proc.stdout
    proc = launch(["--ds_config", "zero1", "--run_dir", run, "--resume"], 1, cache_dir)
    assert "at step 4 (12 samples consumed; global batch 4 -> 2 samples" in proc.stdout
    train = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["consumed_samples"] for r in train] == [2, 4, 8, 12, 14, 16]
    # The sample positions every rank of each leg read, from where the legs said they resumed
    # (the loader's own sampler, micro-batch 2): the multiset of the uninterrupted run's 16.
    from dr_scale.data.loader import StepBatchSampler

    def read(start, steps, ranks):
        return [i for rank in range(ranks)
                for batch in StepBatchSampler(2, 1, ranks, rank, start, steps) for i in batch]
    legs = read(0, 2, 1) + read(4, 2, 2) + read(12, 2, 1)
    assert sorted(legs) == read(0, 8, 1) == list(range(16))
    assert [r["consumed_tokens"] for r in train] == [32 * n for n in (2, 4, 8, 12, 14, 16)]
