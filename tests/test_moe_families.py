"""The Qwen2-MoE (models/qwen2_moe.py) and DeepSeek-style (models/glm4_moe.py) families: each
block against transformers' own (forward and backward, fp32); each family trained on one rank
and with expert parallelism 2 (fp32, ZeRO-2, the same micro-batches of 2: losses within 1e-5
over 4 steps, the DeepSeek-style routing biases moved alike by auxiliary-loss-free balancing);
the expert-parallel run exported by `dr-scale export`, loaded by transformers with our logits
(1e-5 of the largest), read back by model.init_from tensor for tensor, also from a folder in
transformers 5's fused expert layout; a resume continues the balanced run exactly."""
import json

import pytest
import torch

from dr_scale.config.schema import ModelConfig, MoEConfig, RunConfig
from dr_scale.errors import DrScaleError
from dr_scale.models import build_model, resolve_shape
from tests.conftest import launch, module_folder, stopped_at
from tests.test_export import export
from tests.test_train_distributed import fp32_config, records

FAMILIES = {"qwen2_moe": "qwen2_moe_tiny", "glm4_moe": "deepseek_moe_tiny"}
COMMON = ["data.seq_length=64", "train.max_steps=4", "train.warmup_steps=1",
          "train.log_interval=1", "train.eval_interval=4", "train.save_interval=2",
          "train.eval_samples=8", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.lr=3e-3", "logging.plot=false", "logging.tensorboard=false"]
# (deepseek_moe_tiny balances by its routing bias at 0.01 a step, as shipped)
EXTRA = {"qwen2_moe": [], "glm4_moe": []}


def random_block(preset: str, seed: int = 0):
    """The preset's second block's MoE (its first is dense) with small random weights and, for
    a routing bias, a random one."""
    from dr_scale.models.moe import SparseMoE

    torch.manual_seed(seed)
    shape = resolve_shape(ModelConfig(preset=preset))
    block = SparseMoE(shape.hidden_size, shape.ffn_hidden_size, shape.moe)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.08)
        if shape.moe.expert_bias:
            block.gate.expert_bias.normal_(0, 0.05)
    return shape, block


def hf_block(arch: str, shape, ours):
    """transformers' MoE block of the family with `ours`'s weights (experts fused)."""
    from dr_scale.export.hf import hf_config
    from transformers import AutoConfig

    fields = {k: v for k, v in hf_config(shape, 0).items()
              if k not in ("architectures", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if arch == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        theirs, shared = Qwen2MoeSparseMoeBlock(config), "shared_expert"
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        theirs, shared = Glm4MoeMoE(config), "shared_experts"
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        if hasattr(theirs.gate, "e_score_correction_bias"):
            theirs.gate.e_score_correction_bias.copy_(ours.gate.expert_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], 1))
        theirs.experts.down_proj.copy_(ours.experts.w2)
        for p in ("gate_proj", "up_proj", "down_proj"):
            getattr(getattr(theirs, shared), p).weight.copy_(
                getattr(ours.shared_experts, p).weight)
        if hasattr(theirs, "shared_expert_gate"):
            theirs.shared_expert_gate.weight.copy_(ours.shared_gate.weight)
    return theirs


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_block_equals_transformers(arch):
    """Routing (Qwen: softmax, top-2 unnormalised, a gated shared expert; DeepSeek-style:
    sigmoid, the bias choosing, renormalised, a shared expert), the experts and the combine:
    output, input gradient and every weight's gradient within 1e-5 of the largest, 1,024
    positions."""
    shape, ours = random_block(FAMILIES[arch])
    theirs = hf_block(arch, shape, ours)
    x = torch.randn(2, 512, shape.hidden_size, generator=torch.Generator().manual_seed(1))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    weights = torch.linspace(-1, 1, shape.hidden_size)
    outs = [m(v) for m, v in zip((ours, theirs), xs)]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    for o in outs:
        (o * weights).sum().backward()
    pairs = {"output": (outs[0].detach(), outs[1].detach()), "input": (xs[0].grad, xs[1].grad),
             "router": (ours.gate.weight.grad, theirs.gate.weight.grad),
             "w1 and w3": (torch.cat([ours.experts.w1.grad, ours.experts.w3.grad], 1),
                           theirs.experts.gate_up_proj.grad),
             "w2": (ours.experts.w2.grad, theirs.experts.down_proj.grad)}
    for name, (got, want) in pairs.items():
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), name
    # the bias chose: with it zeroed other experts win for some tokens
    if shape.moe.expert_bias:
        chosen = ours.route(x.view(-1, shape.hidden_size))[2]
        with torch.no_grad():
            ours.gate.expert_bias.zero_()
        assert not torch.equal(chosen, ours.route(x.view(-1, shape.hidden_size))[2])


@pytest.fixture(scope="module")
def family_runs(request, cache_dir, tmp_path_factory):
    base = module_folder(request, tmp_path_factory, "families")
    ds = fp32_config(base, 2)
    runs = {}
    for arch, preset in FAMILIES.items():
        for ranks in (1, 2):
            runs[arch, ranks] = run = base / f"{arch}_{ranks}"
            launch(["--ds_config", ds, "--run_dir", run, f"model.preset={preset}", *COMMON,
                    *EXTRA[arch], f"parallel.expert_parallel={ranks}"], ranks, cache_dir)
    # the DeepSeek-style family's experts partitioned by ZeRO-3 over their expert-data groups
    runs["glm4_moe", "zero3"] = run = base / "glm4_moe_zero3"
    launch(["--ds_config", fp32_config(base, 3), "--run_dir", run,
            f"model.preset={FAMILIES['glm4_moe']}", *COMMON, "parallel.expert_parallel=2"], 2,
           cache_dir)
    return ds, runs


def losses(run, after=0):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r and r["step"] > after}


def routing_biases(run, step: int) -> torch.Tensor:
    state = torch.load(run / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)["module"]
    return torch.stack([v for k, v in state.items() if k.endswith("expert_bias")])


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_expert_parallel_equals_one_rank(family_runs, arch):
    _, runs = family_runs
    want, got = losses(runs[arch, 1]), losses(runs[arch, 2])
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    assert want[4] < want[1] - 0.3  # it learns
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    if arch == "glm4_moe":  # the biases moved (by the rate, 4 steps), the same on both layouts
        one, two = (routing_biases(runs[arch, n], 4) for n in (1, 2))
        assert one.abs().max().item() == pytest.approx(0.04) and torch.equal(one, two)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_export_to_transformers_and_back(family_runs, tmp_path, arch):
    from transformers import AutoModelForCausalLM
    from safetensors.torch import save_file

    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.export.hf import apply_init_from, load_into

    _, runs = family_runs
    run, out = runs[arch, 2], tmp_path / "hf"
    proc = export(run, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shape = run_shape(run)
    ours = build_model(shape).eval()
    ours.load_state_dict(consolidated_state_dict(run / "checkpoints", "step_00000004", shape))
    if arch == "glm4_moe":  # the routing biases travel with the weights
        assert torch.equal(torch.stack([b for n, b in ours.named_buffers()
                                        if n.endswith("expert_bias")]),
                           routing_biases(run, 4))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    ids = torch.randint(0, shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        assert (ours(ids) - want).abs().max().item() <= 1e-5 * want.abs().max().item()

    fused = tmp_path / "fused"  # transformers 5's layout: each block's experts in one tensor
    fused.mkdir()
    (fused / "config.json").write_text((out / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(fused / "model.safetensors"), metadata={"format": "pt"})
    for folder in (out, fused):
        cfg = RunConfig()
        cfg.model.init_from = str(folder)
        weights = apply_init_from(cfg)
        assert cfg.model.arch == arch and cfg.model.moe.num_experts == 8
        imported = build_model(shape)
        load_into(imported, weights, str(folder))
        for name, tensor in ours.state_dict().items():
            assert torch.equal(imported.state_dict()[name], tensor), (folder.name, name)


def test_zero3_keeps_the_biases_through_export(family_runs, tmp_path):
    """EP 2 at ZeRO-3: the ZeRO-2 run's losses (1e-6), and its export (through DeepSpeed's
    universal form, which leaves the routing biases to the model-states file) the ZeRO-2 run's
    export: every tensor within 1e-5 of the largest, the biases bitwise."""
    from safetensors.torch import load_file

    _, runs = family_runs
    zero2, zero3 = losses(runs["glm4_moe", 2]), losses(runs["glm4_moe", "zero3"])
    assert sorted(zero3) == sorted(zero2)
    assert all(zero3[s] == pytest.approx(zero2[s], rel=1e-6) for s in zero2)
    tensors = {}
    for key in (2, "zero3"):
        out = tmp_path / str(key)
        proc = export(runs["glm4_moe", key], out)
        assert proc.returncode == 0, proc.stderr[-2000:]
        tensors[key] = load_file(next(out.glob("*.safetensors")))
    want, got = tensors[2], tensors["zero3"]
    assert want.keys() == got.keys()
    scale = max(t.abs().max().item() for t in want.values())
    for name in want:
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(got[name], want[name]) and want[name].abs().max() > 0, name
        else:
            assert (got[name] - want[name]).abs().max().item() <= 1e-5 * scale, name


def test_resume_on_another_layout_keeps_the_biases(family_runs, cache_dir, tmp_path):
    """EP 2 stopped after step 2, resumed on one rank through DeepSpeed's universal form (which
    restores parameters only: dr_scale copies the saved buffers back): steps 3-4 continue the
    uninterrupted run (1e-5) and its step-4 biases are the uninterrupted run's, bitwise."""
    ds, runs = family_runs
    run = tmp_path / "resumed"
    stopped_at(runs["glm4_moe", 2], run, 2)
    proc = launch(["--ds_config", ds, "--run_dir", run, "--resume", "auto",
                   f"model.preset={FAMILIES['glm4_moe']}", *COMMON,
                   "parallel.expert_parallel=1"], 1, cache_dir, launcher="python")
    assert "resharding" in proc.stdout + proc.stderr
    want, got = losses(runs["glm4_moe", 2], after=2), losses(run, after=2)
    assert sorted(got) == [3, 4]
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want)
    assert torch.equal(routing_biases(run, 4), routing_biases(runs["glm4_moe", 2], 4))


def test_resume_continues_the_balanced_run(family_runs, cache_dir, tmp_path):
    """The routing biases are saved with the weights: stopped after step 2 and resumed (EP 2),
    steps 3-4 are the uninterrupted run's, bit for bit."""
    ds, runs = family_runs
    run = tmp_path / "resumed"
    stopped_at(runs["glm4_moe", 2], run, 2)
    launch(["--ds_config", ds, "--run_dir", run, "--resume", "auto",
            f"model.preset={FAMILIES['glm4_moe']}", *COMMON, *EXTRA["glm4_moe"],
            "parallel.expert_parallel=2"], 2,
           cache_dir)
    want, got = losses(runs["glm4_moe", 2], after=2), losses(run, after=2)
    assert sorted(got) == [3, 4] and got == want


@pytest.mark.parametrize("preset, moe, pattern", [
    ("moe_tiny", {"score": "sigmoid"}, r"model\.moe\.score=sigmoid cannot be expressed by "
                                       r"transformers' MixtralForCausalLM .* glm4_moe"),
    ("moe_tiny", {"top_k": 1}, r"model\.moe\.route_norm=False cannot be expressed .* qwen2_moe"),
    ("qwen2_moe_tiny", {"bias_update_rate": 0.01}, r"model\.moe\.expert_bias=True .* glm4_moe"),
])
def test_export_refuses_routing_the_class_cannot_compute(tmp_path, preset, moe, pattern):
    from dr_scale.export.hf import hf_config

    shape = resolve_shape(ModelConfig(preset=preset, moe=MoEConfig(**moe)))
    with pytest.raises(DrScaleError, match=pattern) as e:
        hf_config(shape, 0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset, total, idle", [
    # the published sizes: Qwen1.5-MoE-A2.7B 14.3B of which 2.7B active (24 MoE layers, 56 of
    # 60 experts of 3 x 2048 x 1408 idle for a token); DeepSeekMoE-16B 16.4B of which 2.8B
    # active (27 MoE layers after its dense first, 58 of 64 experts idle)
    ("qwen1_5_moe_a2_7b", 14_315_784_192, 24 * 56 * 3 * 2048 * 1408),
    ("deepseek_moe_16b", 16_375_728_128, 27 * 58 * 3 * 2048 * 1408)])
def test_presets_count_as_transformers_builds_them(preset, total, idle):
    """Our model and transformers' class built from our exported config.json (both on meta)
    have the same parameters (transformers' routing bias is a buffer, ours too); the active
    count leaves out the experts a token is not routed to."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dr_scale.export.hf import hf_config
    from dr_scale.models.build import count_parameters, spec_of

    shape = resolve_shape(ModelConfig(preset=preset))
    n = count_parameters(build_model(shape, device="meta"))
    fields = {k: v for k, v in hf_config(shape, 0).items()
              if k not in ("architectures", "torch_dtype", "dtype")}
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert n == sum(p.numel() for p in theirs.parameters()) == total
    assert spec_of(shape.arch).active_parameters(shape, n) == total - idle
