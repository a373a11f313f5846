"""Hugging Face export and import: logits against `transformers`, and a round trip through a run."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, launch, module_folder

SHORT = ["data.seq_length=64", "train.max_steps=8", "train.warmup_steps=2",
         "train.log_interval=4", "train.eval_interval=8", "train.save_interval=8",
         "train.eval_samples=16", "logging.plot=false", "logging.tensorboard=false"]


def export(run_dir, out, *extra):
    return subprocess.run([sys.executable, "-m", "dr_scale.cli", "export", "--run_dir",
                           str(run_dir), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def trained_run(request, cache_dir, tmp_path_factory):
    run = module_folder(request, tmp_path_factory, "export") / "run"
    launch(["--ds_config", "zero3", "--run_dir", run, *SHORT, "model.tie_embeddings=false"], 2,
           cache_dir)
    return run


def ours_from_run(run):
    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.models import build_model

    shape = run_shape(run)
    model = build_model(shape)
    state = consolidated_state_dict(run / "checkpoints", "step_00000008", shape)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("shard", [None, "3MB"])
def test_export_loads_in_transformers_with_equal_logits(trained_run, tmp_path, shard):
    """One file, or (a ZeRO-3 checkpoint streamed a tensor at a time) shards of at most 3 MB
    with an index: the same bytes as the consolidated weights; transformers' logits are ours."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from dr_scale.export.safetensors_folder import HFWeights

    out = tmp_path / "hf"
    proc = export(trained_run, out, *(["--max_shard_size", shard] if shard else []))
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in out.glob("*.safetensors"))
    ours = ours_from_run(trained_run)
    if shard:
        assert len(files) > 2 and (out / "model.safetensors.index.json").is_file()
        held = {}
        for name, path in HFWeights(out).file_of.items():
            held.setdefault(path.name, []).append(name)
        for f in files:  # over the limit only a tensor larger than it, alone in its file
            assert (out / f).stat().st_size <= 3 * 10 ** 6 or len(held[f]) == 1, (f, held[f])
    else:
        assert files == ["model.safetensors"]
    weights = HFWeights(out)
    for name, value in ours.state_dict().items():
        assert torch.equal(weights.read(name), value), name
    hf = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), hf(ids).logits
    assert (a - b).abs().max().item() < 1e-4  # fp32 both; attention kernels differ in order
    # The tokenizer transformers loads gives the ids ours gives.
    from dr_scale.data.tokenizer import load_tokenizer

    text = "And God said, Let there be light: and there was light.\nNew line\tand tab."
    assert AutoTokenizer.from_pretrained(str(out)).encode(text, add_special_tokens=False) == \
        load_tokenizer(trained_run / "tokenizer.model").encode(text)


def test_import_of_a_sharded_transformers_llama3_matches_its_logits(tmp_path):
    """A Llama-3 style folder (llama3 rotary scaling, shards + index) imported tensor by tensor
    gives transformers' logits; written back by our exporter, transformers reads the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dr_scale.export.hf import load_into, read_folder
    from dr_scale.models import build_model
    from dr_scale.models.build import ModelShape

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="300KB")
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    fields, weights = read_folder(tmp_path / "hf")
    assert fields["rope_scaling"]["factor"] == 8.0
    ours = build_model(ModelShape(**fields)).eval()
    load_into(ours, weights, "hf")
    ids = torch.randint(0, 512, (2, 200))  # past the original 64 positions: scaling matters
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-4
    no_scaling = build_model(ModelShape(**{**fields, "rope_scaling": None})).eval()
    no_scaling.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (no_scaling(ids) - hf(ids).logits).abs().max().item() > 1e-2  # it is tested
    # and back: our config (rope scaling included) and streamed shards, read by transformers
    from dr_scale.export.checkpoint_source import WholeSource
    from dr_scale.export.hf import write_config
    from dr_scale.export.safetensors_folder import write_shards

    back = tmp_path / "back"
    write_config(back, ours.shape, eod_id=2)
    source = WholeSource(ours.state_dict())
    write_shards(back, source.entries, source.pieces, torch.float32, 300_000)
    again = LlamaForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() < 1e-4



@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_exports_as_transformers_gpt2_and_imports_back(tmp_path, tied):
    """GPT-2 through its state-dict adapter: q/k/v fused into c_attn, Conv1D's transposed
    matrices, `transformer.` names; transformers' GPT2LMHeadModel computes our logits, and the
    folder read back (model.init_from's path) gives our tensors bit for bit."""
    from transformers import GPT2LMHeadModel

    from dr_scale.config import load_config
    from dr_scale.export.checkpoint_source import WholeSource
    from dr_scale.export.hf import load_into, read_folder, write_config, write_weights
    from dr_scale.kernels import ops
    from dr_scale.models import build_model, resolve_shape

    ops.use_kernels("cpu", torch.float32, {})
    cfg = load_config(None, ["model.preset=gpt2_tiny", f"model.tie_embeddings={str(tied).lower()}",
                             "model.vocab_size=512"])
    shape = resolve_shape(cfg.model)
    torch.manual_seed(0)
    ours = build_model(shape).eval()
    out = tmp_path / "hf"
    write_config(out, shape, eod_id=0)
    write_weights(out, WholeSource(ours.state_dict()), shape)
    hf = GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-5
    fields, weights = read_folder(out)
    assert fields["arch"] == "gpt2" and fields["tie_embeddings"] == tied
    torch.manual_seed(5)
    back = build_model(shape)
    load_into(back, weights, str(out))
    for (name, a), b in zip(back.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("layout", [["parallel.tensor_parallel=2"]], ids=["tp2"])
def test_round_trip_export_then_init_from_continues_the_loss(trained_run, cache_dir, tmp_path,
                                                             layout):
    """Under TP each rank reads its slices of the folder's tensors into a model built on meta
    (a whole-model init_from continues in tests/test_hf_tokenizer.py and tests/test_qwen2.py)."""
    out = tmp_path / "hf"
    assert export(trained_run, out).returncode == 0
    run = tmp_path / "continued"
    launch(["--ds_config", "zero1", "--run_dir", run, *SHORT, f"model.init_from={out}",
            "train.max_steps=2", "train.eval_interval=2", "train.save_interval=2", *layout], 2,
           cache_dir)
    before = [json.loads(l) for l in (trained_run / "metrics.jsonl").read_text().splitlines()]
    after = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    final_eval = [r["eval_loss"] for r in before if "eval_loss" in r][-1]
    start_eval = [r["eval_loss"] for r in after if "eval_loss" in r][0]
    assert start_eval == pytest.approx(final_eval, rel=1e-2)  # bf16 forward both times
    if layout:  # the checkpoint keeps what DeepSpeed's universal conversion needs of AutoTP
        import torch
        from deepspeed.checkpoint.constants import (PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                                    UNIVERSAL_CHECKPOINT_INFO)

        files = sorted((run / "checkpoints" / "step_00000002").glob("*model_states.pt"))
        assert files
        for f in files:
            info = torch.load(f, map_location="cpu", weights_only=False)[UNIVERSAL_CHECKPOINT_INFO]
            assert info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS), (f.name, sorted(info))


@pytest.mark.parametrize("setup, pattern", [
    (lambda run, out: (run / "run.json").unlink(), r"run\.json: not found"),
    (lambda run, out: (out.mkdir(), (out / "x").write_text("keep")), r"exists and is not empty"),
    (lambda run, out: None, r"step 3: no such checkpoint; have: 8"),
    (lambda run, out: None, r"--max_shard_size: expected a size such as 5GB, 500MB or 2GiB, "
                            r"got 'lots'"),
])
def test_export_bad_input(trained_run, tmp_path, setup, pattern):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    out = tmp_path / "out"
    setup(run, out)
    proc = export(run, out, *(["--step", "3"] if "step 3" in pattern else []),
                  *(["--max_shard_size", "lots"] if "max_shard_size" in pattern else []))
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert len(lines) == 1 and __import__("re").search(pattern, lines[0]), proc.stderr
    if (out / "x").exists():
        assert (out / "x").read_text() == "keep"
