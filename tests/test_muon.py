"""Muon (parallel/muon.py): DeepSpeed's MuonWithAuxAdam, the blocks' matrices Muon's and the rest
AdamW's, built by dr_scale from the spec's modules. The tiny model in fp32 (Newton-Schulz in fp32,
ns_dtype "auto"), 6 steps of the same micro-batches: ZeRO-1, ZeRO-2 and ZeRO-3 on 2 ranks, TP 2
(each split matrix orthogonalised whole), PP 2 and PP 2 x TP 2 give one rank's losses within 1e-5
relative;
moe_tiny with EP 2 gives its one rank's; a ZeRO-1 run stopped after step 3 resumes bitwise, and
on another layout (TP 2 -> ZeRO-1, ZeRO-3 -> ZeRO-1, ZeRO-1 -> ZeRO-3) through the universal
form continues the target's losses, which zeroing the carried momentum breaks; a ZeRO-0 bf16
run's export is scored by transformers as the run scored itself; what cannot work is refused in
one line before any process group."""
import json
import shutil

import pytest
import torch

from dr_scale.callbacks.build import build_callbacks
from dr_scale.config import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.errors import DrScaleError
from dr_scale.models import build_model, resolve_shape
from dr_scale.parallel import muon
from tests.conftest import launch, module_folder, stopped_at
from tests.test_train_distributed import records

COMMON = ["data.seq_length=64", "train.max_steps=6", "train.warmup_steps=2",
          "train.log_interval=1", "train.eval_interval=6", "train.save_interval=3",
          "train.eval_samples=16", "train.global_batch_size=8", "train.micro_batch_size=2",
          "logging.plot=false", "logging.tensorboard=false"]
# name: (ranks, ZeRO stage, overrides)
LAYOUTS = {"1 rank": (1, 1, []), "ZeRO-1 DP 2": (2, 1, []), "ZeRO-2 DP 2": (2, 2, []),
           "ZeRO-3 DP 2": (2, 3, []), "TP 2": (2, 1, ["parallel.tensor_parallel=2"]),
           "PP 2": (2, 1, ["parallel.pipeline_parallel=2"]),
           "PP 2 x TP 2": (4, 1, ["parallel.pipeline_parallel=2", "parallel.tensor_parallel=2"]),
           "moe 1 rank": (1, 2, ["model.preset=moe_tiny"]),
           "moe EP 2": (2, 2, ["model.preset=moe_tiny", "parallel.expert_parallel=2"])}


def muon_config(folder, stage: int):
    """The bundled ZeRO-`stage` config with the bundled Muon section, in fp32."""
    ds = json.loads((dsc.DS_CONFIG_DIR / f"zero{stage}.json").read_text())
    ds["optimizer"] = json.loads((dsc.DS_CONFIG_DIR / "zero1_muon.json").read_text())["optimizer"]
    ds["bf16"] = {"enabled": False}
    path = folder / f"zero{stage}_muon_fp32.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.fixture(scope="module")
def muon_runs(request, cache_dir, tmp_path_factory):
    base = module_folder(request, tmp_path_factory, "muon")
    runs = {}
    for name, (ranks, stage, overrides) in LAYOUTS.items():
        runs[name] = base / name.replace(" ", "_")
        launch(["--ds_config", muon_config(base, stage), "--run_dir", runs[name], *COMMON,
                *overrides], ranks, cache_dir)
    return base, runs


def losses(run):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


def test_layouts_give_one_ranks_losses(muon_runs):
    _, runs = muon_runs
    for reference, names in (("1 rank", ["ZeRO-1 DP 2", "ZeRO-2 DP 2", "ZeRO-3 DP 2", "TP 2",
                                         "PP 2", "PP 2 x TP 2"]),
                             ("moe 1 rank", ["moe EP 2"])):
        want = losses(runs[reference])
        assert sorted(want) == [1, 2, 3, 4, 5, 6] and want[6] < want[1] - 1, reference
        for name in names:
            got = losses(runs[name])
            assert sorted(got) == sorted(want), name
            for step in want:
                # measured: 1e-7 apart; Newton-Schulz of each tensor-parallel slice instead of
                # the whole matrix is 0.5% off at step 2
                assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)


def test_the_checkpoint_holds_muons_state(muon_runs):
    """Muon really ran: its group holds the blocks' matrices and a momentum, AdamW's the rest,
    each at its own rate of the same schedule."""
    _, runs = muon_runs
    saved = torch.load(runs["1 rank"] / "checkpoints" / "step_00000006" /
                       "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    base = saved["optimizer_state_dict"]["base_optimizer_state"]
    groups = base["param_groups"]
    assert [(g["name"], g["use_muon"]) for g in groups] == [
        ("decay-muon", True), ("decay-adamw", False), ("no_decay-adamw", False)]
    assert groups[0]["lr"] / groups[0]["initial_lr"] == pytest.approx(
        groups[1]["lr"] / groups[1]["initial_lr"])
    assert (groups[0]["initial_lr"], groups[1]["initial_lr"]) == (0.02, 3e-3)
    # tiny: 4 layers x (q, k, v, o, gate, up, down); AdamW: the (tied) embedding; the norms
    d, kv, f = 256, 128, 704
    muon_numel = 4 * (2 * d * d + 2 * kv * d + 3 * d * f)
    assert base["state"][0]["momentum_buffer"].numel() == muon_numel
    assert set(base["state"][1]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_stopped_run_resumes_bitwise(muon_runs, cache_dir, tmp_path):
    base, runs = muon_runs
    run = tmp_path / "resumed"
    stopped_at(runs["ZeRO-1 DP 2"], run, 3)
    launch(["--ds_config", muon_config(base, 1), "--run_dir", run, "--resume", "auto",
            *COMMON], 2, cache_dir)
    assert losses(run) == losses(runs["ZeRO-1 DP 2"])


def muon_parameters(udir):
    """Names of the parameters in a universal folder's Muon groups (their exp_avg.pt holds the
    momentum: checkpoint/muon_state.py)."""
    opt = torch.load(udir / "zero" / "optimizer_state.pt", weights_only=False)
    groups = opt.get("param_groups") or opt.get("optimizer_state_dict", {}).get("param_groups")
    path = next(p for pattern in ("mp_rank_*_model_states.pt",
                                  "zero_pp_rank_0_mp_rank_*_model_states.pt")
                for p in sorted(udir.glob(pattern)))
    states = torch.load(path, weights_only=False)
    return [name for group, shapes in zip(groups or [], states["param_shapes"])
            if group.get("use_muon") for name in shapes]


@pytest.mark.parametrize("source, target", [("TP 2", "ZeRO-1 DP 2"),
                                            ("ZeRO-3 DP 2", "ZeRO-1 DP 2"),
                                            ("ZeRO-1 DP 2", "ZeRO-3 DP 2")])
def test_a_resume_on_another_layout_carries_the_momentum(muon_runs, cache_dir, tmp_path,
                                                         source, target):
    """Stopped after step 3, resumed on another layout through the universal form: the target's
    uninterrupted losses; the same resume with the converted momentum zeroed does not give them
    (the momentum is what carries)."""
    base, runs = muon_runs
    want = losses(runs[target])
    args = ["--ds_config", muon_config(base, LAYOUTS[target][1]), "--resume", "auto", *COMMON,
            "parallel.tensor_parallel=1"]
    run = tmp_path / "resumed"
    stopped_at(runs[source], run, 3)
    launch([*args, "--run_dir", run], 2, cache_dir)
    got = losses(run)
    assert sorted(got) == sorted(want)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (source, step)
    universal = run / "checkpoints" / "universal"
    control = tmp_path / "control"
    stopped_at(runs[source], control, 3)
    shutil.copytree(universal, control / "checkpoints" / "universal")
    udir, = (control / "checkpoints" / "universal").glob("*/step_00000003")
    momenta = muon_parameters(udir)
    assert len(momenta) == 28  # tiny's matrices: 4 layers x 7
    for name in momenta:  # the momentum rides in exp_avg.pt (muon_state.py)
        path = udir / "zero" / name / "exp_avg.pt"
        saved = torch.load(path, weights_only=False)
        torch.save({**saved, "param": torch.zeros_like(saved["param"])}
                   if isinstance(saved, dict) else torch.zeros_like(saved), path)
    launch([*args, "--run_dir", control], 2, cache_dir)
    zeroed = losses(control)
    # measured: 9.4e-4 apart at step 5 (step 4's loss comes before the first update)
    assert max(abs(zeroed[s] - want[s]) / want[s] for s in (5, 6)) > 1e-4, (zeroed, want)


def test_a_resume_on_another_layout_or_optimizer_is_one_line(muon_runs, cache_dir, tmp_path):
    """On one rank: a Muon checkpoint of 2 pipeline stages is refused (the momentum is carried
    between plain and tensor-parallel layouts); a ZeRO-1 one resumed with AdamW (the bundled
    zero1) is refused for the optimizer."""
    base, runs = muon_runs
    for i, (source, ds, expected) in enumerate([
            ("PP 2", muon_config(base, 1), "a Muon checkpoint (2 rank(s), ZeRO-1/2, TP 1 x PP 2 "
             "x EP 1) changes layout only without pipeline or expert parallelism on either "
             "side"),
            ("ZeRO-1 DP 2", "zero1", "holds the state of optimizer muon, and this run's is "
             "adamw")]):
        run = tmp_path / f"run{i}"
        stopped_at(runs[source], run, 3)
        before = sorted(str(p) for p in run.rglob("*"))
        proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", "auto", *COMMON,
                       "parallel.pipeline_parallel=1"], 1, cache_dir, check=False,
                      launcher="python")
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
        assert expected in errors[0] and "Traceback" not in proc.stderr, errors
        assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("preset, adamw", [
    ("tiny", {"model.embed_tokens.weight"}),
    ("gpt2_tiny", {"wte.weight", "wpe.weight"}),  # DeepSpeed's by-name rule: wpe Muon's
    ("qwen2_tiny", {"model.embed_tokens.weight", "lm_head.weight"}),
    ("moe_tiny", {"model.embed_tokens.weight"} | {f"model.layers.{i}.mlp.gate.weight"
                                                  for i in range(4)}),
])
def test_muon_steps_the_blocks_matrices_only(preset, adamw):
    model = build_model(resolve_shape(load_config(overrides=[f"model.preset={preset}"]).model,
                                      512), device="meta")
    muon.tag(model)
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert {n for n, p in model.named_parameters() if p.use_muon} == matrices - adamw
    experts = {n for n, p in model.named_parameters() if getattr(p, "is_expert_group", False)}
    assert experts == {n for n in matrices if ".experts." in n}
    assert all(p.ndim == 3 for n, p in model.named_parameters() if n in experts)


def fill(tmp_path, optimizer: dict, *overrides, stage=1):
    ds = json.loads((dsc.DS_CONFIG_DIR / f"zero{stage}.json").read_text())
    if optimizer is None:
        ds.pop("optimizer")
    else:
        ds["optimizer"] = optimizer
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return dsc.load(str(path), load_config(overrides=list(overrides)), dp_size=1)


MUON = {"type": "Muon", "params": {"lr": "auto", "muon_lr": "auto", "momentum": "auto",
                                   "weight_decay": "auto", "betas": [0.9, 0.95], "eps": 1e-8}}


def test_the_experiment_config_and_the_json_agree(tmp_path):
    ds = fill(tmp_path, MUON, "train.muon_lr=0.03")
    assert ds["optimizer"]["params"] == {**MUON["params"], "lr": 3e-3, "muon_lr": 0.03,
                                         "momentum": 0.95, "weight_decay": 0.1,
                                         "ns_method": "gram", "ns_dtype": "deepspeed"}
    assert ds["gradient_clipping"] == 0.0  # train.grad_clip null: off with Muon, 1.0 with AdamW
    assert fill(tmp_path, None)["gradient_clipping"] == 1.0
    assert fill(tmp_path, MUON, "train.grad_clip=0")["gradient_clipping"] == 0.0
    fp32 = fill(tmp_path, dict(MUON), stage=3)
    assert fp32["zero_optimization"]["reduce_scatter"] is False
    # train.optimizer=muon without an optimizer section: the bundled zero1_muon.json's
    ds = fill(tmp_path, None, "train.optimizer=muon")
    assert ds["optimizer"]["type"] == "Muon" and ds["optimizer"]["params"]["muon_lr"] == 0.02
    for name in ("zero1_muon", "zero3_muon"):
        cfg = load_config(overrides=["train.micro_batch_size=4", "train.global_batch_size=32"])
        ds = dsc.load(name, cfg, dp_size=2)
        assert dsc.optimizer_type(ds) == "muon" and ds["gradient_clipping"] == 0.0
        assert "auto" not in json.dumps(ds)


@pytest.mark.parametrize("optimizer, overrides, stage, message", [
    (MUON, ["train.grad_clip=1.0"], 1, r"ds\.json: gradient_clipping=1\.0 with optimizer Muon: "
     r"DeepSpeed clips Muon's orthogonalised update, not the gradient"),
    ({**MUON, "params": {**MUON["params"], "adam_lr": 1e-3}}, [], 1,
     r"optimizer\.params\.adam_lr: the AdamW half's rate is optimizer\.params\.lr"),
    ({**MUON, "params": {**MUON["params"], "per_head_muon": True}}, [], 1,
     r"optimizer\.params\.per_head_muon: not supported here"),
    ({**MUON, "params": {**MUON["params"], "ns_dtype": "fp8"}}, [], 1,
     r"optimizer\.params\.ns_dtype: expected one of auto, deepspeed, fp32, bf16, fp16, got 'fp8'"),
    ({**MUON, "params": {**MUON["params"], "muon_lr": 0.05}}, [], 1,
     r"optimizer\.params\.muon_lr=0\.05 disagrees with train\.muon_lr=0\.02"),
    (None, ["train.optimizer=adamw"], 1, None),
    ({"type": "AdamW", "params": {}}, ["train.optimizer=muon"], 1,
     r"optimizer\.type='AdamW' disagrees with train\.optimizer=muon; set one of them to match"),
    (MUON, ["train.optimizer=adamw"], 1,
     r"optimizer\.type='Muon' disagrees with train\.optimizer=adamw"),
])
def test_what_muon_cannot_do_is_one_line(tmp_path, optimizer, overrides, stage, message):
    if message is None:  # no section, train.optimizer=adamw: torch's AdamW (train/engine.py)
        assert dsc.optimizer_type(fill(tmp_path, optimizer, *overrides)) == "adamw"
        return
    with pytest.raises(DrScaleError, match=message):
        fill(tmp_path, optimizer, *overrides, stage=stage)


def test_refusals_of_zero3_reduce_scatter_offload_and_callbacks(tmp_path):
    ds = json.loads((dsc.DS_CONFIG_DIR / "zero3_offload.json").read_text())
    ds["optimizer"] = MUON
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(DrScaleError, match=r"offload_optimizer \(device cpu\) with optimizer "
                                           r"Muon: the offloaded step is DeepSpeed's CPU Adam"):
        dsc.load(str(path), load_config(), dp_size=1)
    ds = json.loads((dsc.DS_CONFIG_DIR / "zero3_muon.json").read_text())
    ds["zero_optimization"]["reduce_scatter"] = True
    path.write_text(json.dumps(ds))
    with pytest.raises(DrScaleError, match=r"reduce_scatter=true with optimizer Muon"):
        dsc.load(str(path), load_config(), dp_size=1)
    for name in ("per_layer_clip", "grad_norm_monitor"):
        with pytest.raises(DrScaleError, match=rf"callbacks\.{name}: not available with "
                                               r"optimizer Muon \(DeepSpeed's ZeRO keeps"):
            build_callbacks({name: {"enabled": True}}, optimizer="muon")
    assert len(build_callbacks({"ema": {"enabled": True}, "nan_guard": {"enabled": True}},
                               optimizer="muon")) == 2


def test_a_zero0_bf16_muon_run_exports_what_it_trained(cache_dir, tmp_path):
    """ZeRO-0 keeps bf16 weights and fp32 masters in the optimizer's groups' order, which is
    Muon's (export/consolidate.py reads it): transformers scores the export as the run scored
    itself (bf16: 1e-2)."""
    from dr_scale.export.score import score
    from tests.test_export import export

    ds = json.loads((dsc.DS_CONFIG_DIR / "zero0.json").read_text())
    ds["optimizer"] = json.loads((dsc.DS_CONFIG_DIR / "zero1_muon.json").read_text())["optimizer"]
    ds["bf16"] = {"enabled": True}
    path = tmp_path / "zero0_muon.json"
    path.write_text(json.dumps(ds))
    run = tmp_path / "run"
    launch(["--ds_config", path, "--run_dir", run, *COMMON, "train.max_steps=3",
            "train.eval_interval=3"], 1, cache_dir)
    proc = export(run, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    scored = score(tmp_path / "hf", run)
    assert scored.relative_difference < 1e-2, scored.as_dict()
