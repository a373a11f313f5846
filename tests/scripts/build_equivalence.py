"""Run by tests/test_build_equivalence.py: one layout's ranks (torch.multiprocessing, gloo) build
every family in fp32 and bf16 the way a run does (config -> build_for_run -> parallelize ->
DeepSpeed engine, the bundled DeepSpeed JSON) and compare what the engine computes on one input
of the model's full length with a plain build from the same seed: the buffers, and the logits.

    python build_equivalence.py PORT OUT LAYOUT    LAYOUT: zero3x1 | zero3x2 | tp2 | pp2

zero3x1 also builds from a transformers folder (model.init_from); zero3x2 also saves a
checkpoint and loads it into an engine built from another seed (resume), and builds Llama in fp32
with its blocks compiled (model.compile=true). Every random draw made
while building is recorded with its tensor's and its generator's devices."""
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode
from rank_result import write_and_leave

LAYOUTS = {  # ranks, tensor, pipeline, DeepSpeed JSON
    "zero3x1": (1, 1, 1, "zero3"), "zero3x2": (2, 1, 1, "zero3"),
    "tp2": (2, 2, 1, "zero3"), "pp2": (2, 1, 2, "zero1"),
}
# the mixture of experts as the DeepSeek-style family: Mixtral's block and more (a dense first
# block, a shared expert, sigmoid routing and its bias buffer)
FAMILIES = {"llama": "tiny", "qwen2": "qwen2_tiny", "gpt2": "gpt2_tiny",
            "glm4_moe": "deepseek_moe_tiny"}
UNPIPELINED = {"glm4_moe"}  # refused under pipeline parallelism
VOCAB = 512


class DrawWatch(TorchFunctionMode):
    """Every call given a random `generator`: its function, the devices of the tensor it fills
    and of the generator, and whether DeepSpeed's zero.Init was open (its constructors then put
    new tensors on the accelerator and in the training dtype)."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        out = func(*args, **kwargs)
        if generator is not None:
            from deepspeed.runtime.zero import partition_parameters

            filled = out if isinstance(out, torch.Tensor) else args[0]
            self.draws.append({"func": getattr(func, "__name__", str(func)),
                               "tensor": str(filled.device), "generator": str(generator.device),
                               "inside_zero_init": partition_parameters.zero_init_context > 0})
        return out


def overrides(family: str) -> list:
    seq = 1024 if family == "gpt2" else 4096  # GPT-2's learned positions: 1,024
    heads = 4 if family == "gpt2" else 2
    return [f"model.preset={FAMILIES[family]}", "model.hidden_size=64", "model.num_layers=2",
            "model.num_heads=4", f"model.num_kv_heads={heads}", "model.ffn_hidden_size=128",
            f"model.max_seq_length={seq}", f"model.vocab_size={VOCAB}", f"data.seq_length={seq}",
            "train.micro_batch_size=1"]


def engine_for(family, precision, topo, ds_name, init_from=None, seed=None, compiled=False):
    """The engine a run of this layout makes, step by step as dr_scale/launch.py makes it."""
    from dr_scale.plan import deepspeed_view
    from dr_scale.runtime.hardware import Bf16Support
    from dr_scale.config import load_config
    from dr_scale.export.hf import apply_init_from, load_into
    from dr_scale.models import resolve_shape
    from dr_scale.parallel.parallelize import parallelize
    from dr_scale.parallel.sharded_build import build_for_run
    from dr_scale.models.kernel_choice import select_kernels
    from dr_scale.train.engine import initialize_engine

    cfg = load_config(None, overrides(family) + (["model.compile=true"] if compiled else []))
    weights = None
    if init_from is not None:
        cfg.model.init_from = str(init_from)
        weights = apply_init_from(cfg)
    shape = resolve_shape(cfg.model)
    view = deepspeed_view(ds_name, cfg, topo, shape, "cpu",
                          Bf16Support(precision == "bf16", "the case's precision"))
    ds = view.filled
    shape = shape.settle_loss_chunk(cfg.data.seq_length, topo.head_slices(True))
    shape, _ = select_kernels(shape, cfg, "cpu", precision, topo)
    torch.manual_seed(cfg.train.seed if seed is None else seed)
    watch = DrawWatch()
    with watch:
        model = build_for_run(shape, ds, topo)
        if weights is not None:
            load_into(model, weights, str(init_from))
        parallel = parallelize(model, shape, topo, cfg, ds, weights)
    engine = initialize_engine(parallel.model, ds, cfg.train, None, view.path, parallel.mpu)
    parallel.after_engine(engine)
    return engine, shape, cfg, watch.draws


def plain_model(shape, precision, seed):
    """The reference: built whole in one process, its parameters cast as DeepSpeed's engine
    casts them (buffers left as they are)."""
    from dr_scale.models import build_model

    torch.manual_seed(seed)
    model = build_model(shape).eval()
    if precision == "bf16":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model


def engine_logits(engine, tokens, tensor_parallel: int):
    """The logits the engine computes for `tokens` (1, seq), whole: under tensor parallelism
    the vocabulary slices gathered; in a pipeline, on its last stage only (None elsewhere)."""
    import torch.distributed as dist

    if hasattr(engine, "eval_batch"):
        _, logits = engine.eval_batch(iter([(tokens, tokens)]), return_logits=True,
                                      compute_loss=False, bcast_loss=False)
        return logits if engine.is_last_stage() else None
    engine.module.eval()
    with torch.no_grad():
        logits = engine(tokens)
    if logits.shape[-1] != VOCAB:  # this rank's vocabulary slice
        from deepspeed.utils import groups

        parts = [torch.empty_like(logits) for _ in range(tensor_parallel)]
        dist.all_gather(parts, logits.contiguous(), group=groups.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits


def compare(engine, reference, logits, ref_logits) -> dict:
    """Buffers by their last two names (a pipeline stage keeps the rotary tables under its layer
    index); logits: largest difference, relative to the largest reference logit."""
    want = {".".join(n.split(".")[-2:]): b for n, b in reference.named_buffers()}
    buffers = {}
    for name, buf in engine.module.named_buffers():
        ref = want[".".join(name.split(".")[-2:])]
        buffers[name] = {"equal": buf.dtype == ref.dtype and torch.equal(buf.cpu(), ref),
                         "dtype": str(buf.dtype),
                         "max_diff": (buf.cpu().double() - ref.double()).abs().max().item()}
    out = {"buffers": buffers, "tokens": int(ref_logits.shape[1])}
    if logits is not None:
        per_position = (logits.double() - ref_logits.double()).abs().amax(dim=-1).flatten()
        out.update(dtype=str(logits.dtype), bitwise=bool(torch.equal(logits, ref_logits)),
                   max_diff=per_position.max().item(),
                   p99_diff=torch.quantile(per_position, 0.99).item(),
                   scale=ref_logits.double().abs().max().item())
    return out


def write_hf_folder(model, shape, folder: Path):
    """A transformers folder of `model` (config.json + safetensors), as `dr-scale export`
    writes one (under transformers' names and layouts)."""
    from dr_scale.export.checkpoint_source import WholeSource
    from dr_scale.export.hf import write_config, write_weights

    write_config(folder, shape, eod_id=0)
    write_weights(folder, WholeSource(model.state_dict()), shape)


def rank_main(rank, port, out, layout):
    world, tensor, pipeline, ds_name = LAYOUTS[layout]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed

    from dr_scale.parallel.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    topo = Topology(world, tensor, pipeline, rank).with_groups()
    result = {}
    for family in FAMILIES:
        if pipeline > 1 and family in UNPIPELINED:
            continue
        for precision in ("fp32", "bf16"):
            engine, shape, cfg, draws = engine_for(family, precision, topo, ds_name)
            seq = cfg.data.seq_length
            tokens = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(7))
            reference = plain_model(shape, precision, cfg.train.seed)
            with torch.no_grad():
                ref_logits = reference(tokens)
            logits = engine_logits(engine, tokens, tensor)
            case = f"{family}/{precision}"
            result[case] = {**compare(engine, reference, logits, ref_logits), "draws": draws}
            if layout == "zero3x1":
                folder = Path(f"{out}.hf.{family}.{precision}")
                write_hf_folder(plain_model(shape, "fp32", cfg.train.seed), shape, folder)
                loaded, _, _, draws = engine_for(family, precision, topo, ds_name,
                                                 init_from=folder, seed=99)
                result[f"{case}/init_from"] = {
                    **compare(loaded, reference, engine_logits(loaded, tokens, tensor),
                              ref_logits), "draws": draws}
            if layout == "zero3x2":
                result[f"{case}/resume"] = resumed(engine, family, precision, topo, ds_name,
                                                   reference, tokens, ref_logits, out)
            if layout == "zero3x2" and case == "llama/fp32":  # inductor's code, hooks between
                compiled, _, _, draws = engine_for(family, precision, topo, ds_name,
                                                   compiled=True)
                result[f"{case}/compiled"] = {
                    **compare(compiled, reference, engine_logits(compiled, tokens, tensor),
                              ref_logits), "draws": draws}
    write_and_leave(out, rank, result)


def resumed(engine, family, precision, topo, ds_name, reference, tokens, ref_logits, out):
    """Save `engine` as the trainer saves, load it into an engine built from another seed as
    --resume loads, and compare the loaded engine with the reference."""
    from dr_scale.checkpoint.load import load
    from dr_scale.checkpoint.writer import CheckpointWriter

    ckpt_dir = Path(f"{out}.ckpt.{family}.{precision}")
    CheckpointWriter(engine, ckpt_dir, topo).save(1, {"model": {}})
    other, _, _, _ = engine_for(family, precision, topo, ds_name, seed=99)
    load(other, ckpt_dir, topo, expected_model={})
    return compare(other, reference, engine_logits(other, tokens, topo.tensor), ref_logits)


if __name__ == "__main__":
    layout = sys.argv[3]
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2], layout), nprocs=LAYOUTS[layout][0])
