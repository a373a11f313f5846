"""The mixture-of-experts family (models/mixtral.py, models/moe.py): its block against
transformers' Mixtral block (forward and backward), grouped experts against the loop, the
capacity's drops, the counts against the published models, and a run: trained on 2 ranks with
the router's figures in the records, exported, loaded and scored by transformers, imported
back."""
import contextlib
import json

import pytest
import torch

from dr_scale.config.schema import ModelConfig, MoEConfig
from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops
from dr_scale.models import build_model, resolve_shape
from dr_scale.models.build import count_parameters, spec_of
from dr_scale.models.moe import MoEShape, SparseMoE
from tests.conftest import launch, stopped_at, module_folder
from tests.test_export import export
from tests.test_train_distributed import records

HIDDEN, FFN, EXPERTS = 64, 96, 8


def hf_block(ours: SparseMoE):
    """transformers' MixtralSparseMoeBlock with `ours`'s weights (its experts fused: gate_up_proj
    is w1 over w3)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
        num_experts_per_tok=ours.moe.top_k, router_jitter_noise=0.0))
    with torch.no_grad():
        block.gate.weight.copy_(ours.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        block.experts.down_proj.copy_(ours.experts.w2)
    return block


def moe_block(capacity_factor=None, seed=0):
    torch.manual_seed(seed)
    block = SparseMoE(HIDDEN, FFN, MoEShape.parse(dict(num_experts=EXPERTS, top_k=2,
                                                     capacity_factor=capacity_factor)))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block


@contextlib.contextmanager
def experts_kernel(name):
    """The registry's `experts` op forced to `name` (model.kernels.experts), as a run sets it."""
    ops.use_kernels("cpu", torch.float32, {"experts": name})
    assert ops._chosen["experts"].name == name
    try:
        yield
    finally:
        ops.reset()


def tokens(n=4096, seed=1):
    return torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_block_equals_transformers_mixtral_over_4k_tokens():
    """Mixtral's routing (softmax, top-2, renormalised) and SwiGLU experts: our block's output
    equals transformers' for the same weights, fp32, 4,096 positions; the grouped matmuls equal
    the one-expert-at-a-time loop; nothing dropped without a capacity."""
    ours, x = moe_block(), tokens()
    theirs = hf_block(ours)
    with torch.no_grad():
        want = theirs(x)
        with experts_kernel("grouped_mm"):
            got = ours(x)
        with experts_kernel("loop"):
            looped = ours(x)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale
    assert (got - looped).abs().max().item() <= 1e-5 * scale
    assert ours.stats.dropped.item() == 0
    assert ours.stats.tokens_per_expert.sum().item() == 2 * 4096


def test_block_gradients_equal_transformers_mixtral():
    """The backward too: the input's gradient and every weight's equal transformers' block's for
    the same weights and output gradient (fp32, 1,024 positions; measured <= 8.2e-7 of the
    largest)."""
    ours, x = moe_block(), tokens(1024)
    theirs = hf_block(ours)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.linspace(-1, 1, HIDDEN)  # every output feature its own gradient
    with experts_kernel("grouped_mm"):
        (ours(ours_x) * weights).sum().backward()
    (theirs(theirs_x) * weights).sum().backward()
    pairs = {"input": (ours_x.grad, theirs_x.grad),
             "router": (ours.gate.weight.grad, theirs.gate.weight.grad),
             "w1 and w3": (torch.cat([ours.experts.w1.grad, ours.experts.w3.grad], dim=1),
                           theirs.experts.gate_up_proj.grad),
             "w2": (ours.experts.w2.grad, theirs.experts.down_proj.grad)}
    for name, (got, want) in pairs.items():
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), name


def test_gradients_of_grouped_experts_equal_the_loop():
    x = tokens(512).requires_grad_()
    grads = {}
    for impl in ("grouped_mm", "loop"):
        block = moe_block()
        x.grad = None
        with experts_kernel(impl):
            (block(x) * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        grads[impl] = [x.grad.clone()] + [p.grad for p in block.parameters()]
    for a, b in zip(grads["grouped_mm"], grads["loop"]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.parametrize("align", [8, 4])  # a GPU's bf16 groups (16 bytes), its fp32 groups
def test_padded_groups_equal_the_loop(align):
    """The GPU's grouped-matmul path pads each expert's rows to a multiple of `align` (an
    expert with none, one row, a multiple already, a last expert taking the spare rows): forward
    and every gradient equal the one-expert-at-a-time loop within 1e-6 of the largest (fp32)."""
    from dr_scale.kernels.grouped import experts_grouped_mm, experts_loop

    counts = torch.tensor([0, 1, 8, 13, 5, 0, 16, 7])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(int(counts.sum()), HIDDEN, generator=g)
    w = [torch.randn(EXPERTS, *shape, generator=g) * 0.1
         for shape in ((FFN, HIDDEN), (HIDDEN, FFN), (FFN, HIDDEN))]
    results = {}
    for name, run in (("padded", lambda *a: experts_grouped_mm(*a, align=align)),
                      ("loop", experts_loop)):
        inputs = [t.clone().requires_grad_() for t in (x, *w)]
        out = run(*inputs, counts)
        (out * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        results[name] = [out.detach()] + [t.grad for t in inputs]
    for got, want in zip(results["padded"], results["loop"]):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_capacity_drops_the_latest_assignments_of_a_busy_expert():
    """capacity_factor 0.5: an expert takes ceil(0.5 x T x 2 / E) assignments, in token order; the
    dropped ones are counted and add nothing, the kept ones are what the drop-free block gives."""
    x = tokens(256)
    free, capped = moe_block(), moe_block(capacity_factor=0.5)
    with torch.no_grad():
        out_free, out_capped = free(x)[0], capped(x)[0]
    counts = capped.stats.tokens_per_expert
    capacity = 32  # ceil(0.5 x 256 x 2 / 8)
    assert capped.stats.dropped.item() == (counts - capacity).clamp(min=0).sum().item() > 0
    # tokens none of whose experts overflowed come out the same
    logits = capped.gate(x[0])
    chosen = torch.topk(torch.softmax(logits, -1), 2, -1).indices
    position = torch.zeros_like(chosen)
    seen = torch.zeros(EXPERTS, dtype=torch.long)
    for t in range(chosen.shape[0]):
        for j in range(2):
            e = chosen[t, j]
            position[t, j] = seen[e]
            seen[e] += 1
    whole = (position < capacity).all(dim=1)
    assert 0 < whole.sum() < 256
    assert torch.allclose(out_free[whole], out_capped[whole], atol=1e-6)
    assert not torch.allclose(out_free[~whole], out_capped[~whole], atol=1e-6)


def test_router_runs_in_fp32_under_bf16():
    block = moe_block().to(torch.bfloat16)
    x = tokens(64).to(torch.bfloat16)
    logits = block.gate(x[0])
    assert logits.dtype == torch.float32
    assert torch.equal(logits, x[0].float() @ block.gate.weight.float().t())
    assert block(x).dtype == torch.bfloat16


def test_presets_count_as_the_published_models():
    """mixtral_8x7b builds (on meta) transformers' Mixtral-8x7B parameter count, 46.7B, of which
    12.9B are active per token (2 of 8 experts); FLOPs per token count the active ones."""
    from transformers import MixtralConfig, MixtralForCausalLM as HFMixtral

    shape = resolve_shape(ModelConfig(preset="mixtral_8x7b"))
    n = count_parameters(build_model(shape, device="meta"))
    with torch.device("meta"):
        theirs = HFMixtral(MixtralConfig())  # its defaults are Mixtral-8x7B's
    assert n == sum(p.numel() for p in theirs.parameters()) == 46_702_792_704
    spec = spec_of("mixtral")
    active = spec.active_parameters(shape, n)
    assert active == n - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248
    embedding, norms = 32000 * 4096, (2 * 32 + 1) * 4096  # not matmuls
    assert spec.flops_per_token(shape, 0) == 6 * (active - embedding - norms)


def test_capacity_drops_in_training_only():
    """Evaluation scores as the drop-free export does: the capped block in eval mode gives the
    drop-free output and drops nothing."""
    x = tokens(256)
    free, capped = moe_block(), moe_block(capacity_factor=0.5)
    with torch.no_grad():
        want = free.eval()(x)
        got = capped.eval()(x)
    assert torch.equal(got, want) and capped.stats.dropped.item() == 0


def test_top_1_router_learns_from_the_lm_loss():
    """top_k = 1 keeps Switch's raw probability as the weight (route_norm defaults to false), so
    the router's gradient from the output is not zero; renormalised, the weight is always 1 and
    the router would get none."""
    grads = {}
    for route_norm in (None, True):
        torch.manual_seed(0)
        block = SparseMoE(HIDDEN, FFN, MoEShape.parse(dict(num_experts=EXPERTS, top_k=1,
                                                           route_norm=route_norm)))
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.1)
        (block(tokens(128)) * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        grads[route_norm] = block.gate.weight.grad.abs().max().item()
    assert block.moe.route_norm is True and grads[True] < 1e-5  # rounding of w / w only
    assert grads[None] > 1e-3


def test_router_losses_are_summed_over_layers():
    """Megatron's and DeepSeek's convention: each MoE layer's balance loss (1 at balance) and
    z-loss weighted by its coefficient and summed; the loss line shows their mean per layer;
    `sequence` scope averages each sequence's own balance loss."""
    from dr_scale.models.moe import router_losses

    blocks = [moe_block(seed=s) for s in (0, 1, 2)]
    x = tokens(64)
    for b in blocks:
        b(x)
    aux = torch.stack([b.stats.aux_loss for b in blocks])
    z = torch.stack([b.stats.z_loss for b in blocks])
    total, figures = router_losses(blocks, blocks[0].moe)
    assert total.item() == pytest.approx((0.01 * aux.sum() + 0.001 * z.sum()).item(), rel=1e-6)
    assert figures["aux_loss"].item() == pytest.approx(aux.mean().item(), rel=1e-6)
    assert 0.9 < aux.min().item()  # E x sum f P >= ~1 (1 when balanced)

    per_sequence = SparseMoE(HIDDEN, FFN, MoEShape.parse(dict(
        num_experts=EXPERTS, top_k=2, aux_loss_scope="sequence")))
    per_sequence.load_state_dict(blocks[0].state_dict())
    batch = torch.cat([tokens(64, seed=1), tokens(64, seed=2)])
    per_sequence(batch)
    each = []
    for i in range(2):
        blocks[0](batch[i:i + 1])
        each.append(blocks[0].stats.aux_loss)
    assert per_sequence.stats.aux_loss.item() == pytest.approx(
        torch.stack(each).mean().item(), rel=1e-6)


def test_transformers_coefficient_is_converted():
    """transformers pools the layers and counts top_k at balance: moe_tiny's 0.01 per layer over
    4 layers at top-2 is its 0.02, and an import gives 0.01 back."""
    from dr_scale.models.mixtral import hf_config, shape_from_hf

    shape = resolve_shape(ModelConfig(preset="moe_tiny"))
    config = hf_config(shape, 0)
    assert config["router_aux_loss_coef"] == 0.02
    assert shape_from_hf(config, "config.json")["moe"]["aux_loss_coeff"] == 0.01


@pytest.mark.parametrize("fields, pattern", [
    (dict(preset="moe_tiny", moe=MoEConfig(top_k=9)), r"model\.moe: top_k=9 must be between 1 "
                                                      r"and num_experts=8"),
    (dict(preset="tiny", moe=MoEConfig(top_k=2)), r"model\.moe: a dense preset given expert "
                                                  r"settings needs model\.moe\.num_experts"),
    (dict(preset="tiny", moe=MoEConfig(num_experts=4)), r"the llama family has a dense MLP"),
])
def test_bad_expert_settings_are_one_line_errors(fields, pattern):
    with pytest.raises(DrScaleError, match=pattern):
        resolve_shape(ModelConfig(**fields))


RUN = ["model.preset=moe_tiny", "data.seq_length=64", "train.max_steps=8",
       "train.warmup_steps=2", "train.log_interval=2", "train.eval_interval=4",
       "train.save_interval=4", "train.eval_samples=16", "train.global_batch_size=8",
       "train.micro_batch_size=2", "logging.tensorboard=false"]
# the command: each rank holds 4 of each block's 8 experts (tests/test_expert_parallel.py
# compares the layouts)
EP = ["parallel.expert_parallel=2"]


@pytest.fixture(scope="module")
def moe_run(request, cache_dir, tmp_path_factory):
    run = module_folder(request, tmp_path_factory, "moe") / "run"
    launch(["--ds_config", "zero2", "--run_dir", run, *RUN, *EP], 2, cache_dir)
    return run


def test_run_logs_the_router(moe_run):
    """The loss line's loss is the LM loss (what evaluation measures); the router's losses, the
    dropped share and each layer's busiest-expert load are figures of their own; the start line
    gives the active parameters."""
    train = [r for r in records(moe_run) if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train:
        assert 0.9 < r["aux_loss"] < 8 and r["z_loss"] > 0 and r["tokens_dropped"] == 0
        assert len(r["expert_load"]) == 4 and all(1 <= v <= 8 for v in r["expert_load"])
    run = json.loads((moe_run / "run.json").read_text())
    assert run["model"]["shape"]["moe"]["num_experts"] == 8
    assert run["world"]["expert_parallel"] == 2


def test_expert_load_picture_is_the_records(moe_run):
    """expert_load.png beside metrics.jsonl: a heat map whose cells are the records' per-layer
    loads, layers down, logged steps across."""
    import matplotlib.image
    import numpy as np

    from dr_scale.train.expert_load_plot import draw_expert_load
    from dr_scale.train.metrics import read_metrics

    recs = read_metrics(moe_run / "metrics.jsonl")
    cells = np.asarray(draw_expert_load(recs).axes[0].images[0].get_array())
    want = np.array([r["expert_load"] for r in recs if "expert_load" in r]).T
    assert cells.shape == (4, 4) and np.array_equal(cells, want)
    image = matplotlib.image.imread(moe_run / "expert_load.png")
    assert image.shape[0] > 100 and image.shape[1] > 300 and image[..., :3].std() > 0.05


def test_export_is_scored_by_transformers_as_the_run(moe_run, tmp_path):
    """dr-scale export writes a folder transformers loads as MixtralForCausalLM, with our logits
    (fp32 both) and the run's held-out loss (within 1%: the run evaluated in bf16); init_from
    reads it back tensor for tensor."""
    from transformers import MixtralForCausalLM as HFMixtral

    from dr_scale.config.schema import RunConfig
    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.export.hf import apply_init_from, load_into
    from dr_scale.export.score import score

    out = tmp_path / "hf"
    proc = export(moe_run, out)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"],
            config["num_experts_per_tok"]) == (["MixtralForCausalLM"], 8, 2)
    shape = run_shape(moe_run)
    ours = build_model(shape)
    ours.load_state_dict(consolidated_state_dict(moe_run / "checkpoints", "step_00000008", shape))
    hf = HFMixtral.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-4
    scored = score(out, moe_run)
    assert scored.relative_difference < 0.01, scored.as_dict()

    # and a folder in transformers 5's own layout (all experts in one tensor, `mlp.gate`)
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((out / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(fused / "model.safetensors"), metadata={"format": "pt"})
    for folder in (out, fused):
        cfg = RunConfig()
        cfg.model.init_from = str(folder)
        state = apply_init_from(cfg)
        assert (cfg.model.arch, cfg.model.moe.num_experts, cfg.model.moe.top_k) == \
            ("mixtral", 8, 2)
        imported = build_model(shape)
        load_into(imported, state, str(folder))
        for name, tensor in ours.state_dict().items():
            assert torch.equal(imported.state_dict()[name], tensor), (folder.name, name)


def test_resume_continues_the_uninterrupted_losses(moe_run, cache_dir, tmp_path):
    """Stopped after step 4's checkpoint and resumed: steps 5-8 log the uninterrupted run's
    losses and router figures."""
    run = tmp_path / "resumed"
    stopped_at(moe_run, run, 4)
    launch(["--ds_config", "zero2", "--run_dir", run, "--resume", "auto", *RUN, *EP], 2,
           cache_dir)
    want = {r["step"]: r for r in records(moe_run) if "loss" in r and r["step"] > 4}
    got = {r["step"]: r for r in records(run) if "loss" in r and r["step"] > 4}
    assert sorted(got) == [6, 8]
    for step, r in got.items():
        assert r["loss"] == pytest.approx(want[step]["loss"], rel=1e-6), step
        assert r["aux_loss"] == pytest.approx(want[step]["aux_loss"], rel=1e-6), step
