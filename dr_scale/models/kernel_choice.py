"""Which kernel runs each op of a run's model: `model.attention` and `model.kernels` settled for
this process, by measurement on GPUs (kernels/measured.py), by priority on CPU."""
import dataclasses

import torch

from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.kernels import measured, ops
from dr_scale.kernels.registry import candidates, select, unavailable


def check_kernels(shape, cfg, device_type: str, precision: str):
    """The plan's refusals of `model.kernels` and `model.attention`: an unknown op, and a named
    implementation unknown or unable to run here (auto is settled later, by select_kernels)."""
    dtype = dsc.torch_dtype(precision)
    forced = {op: name for op, name in cfg.model.kernels.items() if name != "auto"}
    unknown = sorted(set(cfg.model.kernels) - set(ops.OPS))
    if unknown:
        raise DrScaleError(f"model.kernels.{unknown[0]}: unknown op; known: {', '.join(ops.OPS)}")
    facts = {"per_token_positions": cfg.data.reset_positions}
    for op, name in forced.items():
        try:
            select(op, device_type, dtype, force=name, **facts)
        except DrScaleError as e:
            raise DrScaleError(f"model.{e}") from None
    if shape.attention != "auto":
        try:
            select("attention", device_type, dtype, force=shape.attention,
                   head_dim=shape.head_dim, dropout=shape.dropout)
        except DrScaleError as e:
            raise DrScaleError(f"model.attention: {str(e).split(': ', 1)[-1]}") from None


def select_kernels(shape, cfg, device_type: str, precision: str, topo):
    """Settle `model.attention` and every op's implementation (`model.kernels`) for this process;
    returns the shape with a concrete attention name and the line that says the choices. `auto`
    is, on GPUs, the fastest implementation that passes its precision check on the run's own
    shapes (kernels/measured.py: rank 0 measures, its table is printed, the choice cached); on
    CPU, the best by priority. Positions per token (data.reset_positions) rule out a rotary
    kernel that takes one table."""
    dtype = dsc.torch_dtype(precision)
    forced = dict(cfg.model.kernels)  # names checked by the plan (check_kernels)
    facts = {"per_token_positions": cfg.data.reset_positions}
    unused = () if shape.moe is not None else ("experts",)
    attention_facts = {"head_dim": shape.head_dim, "dropout": shape.dropout}
    if device_type == "cuda":
        auto = {op: candidates(op, device_type, dtype, **facts)
                for op in ops.OPS if forced.get(op, "auto") == "auto" and op not in unused}
        if shape.attention == "auto":
            auto["attention"] = candidates("attention", device_type, dtype, **attention_facts)
        problem = kernel_problem(shape, cfg, topo)
        chosen, table = measured.choose({op: ks for op, ks in auto.items() if ks}, problem,
                                        torch.device("cuda", torch.cuda.current_device()), dtype)
        if topo.rank == 0:
            print(measured.format_table(table, problem, "cuda", dtype), flush=True)
            for reason, names in unavailable(device_type).items():  # e.g. the CUDA build's error
                print(f"kernels: not used ({', '.join(names)}): {reason}", flush=True)
        if "attention" in chosen:
            shape = dataclasses.replace(shape, attention=chosen.pop("attention"))
        forced.update(chosen)
    try:
        line = ops.use_kernels(device_type, dtype, forced, unused, **facts)
    except DrScaleError as e:
        raise DrScaleError(f"model.{e}") from None
    name = shape.attention
    try:
        kernel = select("attention", device_type, dtype, force=None if name == "auto" else name,
                        **attention_facts)
    except DrScaleError as e:
        raise DrScaleError(f"model.attention: {str(e).split(': ', 1)[-1]}") from None
    shape = dataclasses.replace(shape, attention=kernel.name)
    return shape, f"{line}, attention={kernel.name}"


def kernel_problem(shape, cfg, topo) -> measured.Problem:
    """One rank's shapes for the kernel measurement: its heads and MLP columns under tensor
    parallelism, its share of the sequence under sequence parallelism for the row-wise ops
    (attention sees the whole sequence), the loss over a chunk of the fused head or all tokens.
    With document masking, four documents a sequence (the measurement cannot know the corpus's
    lengths; what matters is that the masked paths are the ones timed)."""
    tp, seq, batch = topo.tensor, cfg.data.seq_length, cfg.train.micro_batch_size
    tokens = batch * seq
    chunk = shape.loss_chunk if topo.pipeline == 1 else 0  # settled for the head's slice
    slices = topo.head_slices(cfg.parallel.vocab_parallel)
    return measured.Problem(
        batch=batch, seq=seq, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size // tp,
        heads=shape.num_heads // tp, kv_heads=max(1, shape.num_kv_heads // tp),
        head_dim=shape.head_dim, vocab=-(-shape.vocab_size // slices),
        loss_rows=min(tokens, chunk) if chunk else tokens,
        documents=4 if cfg.data.document_mask else 1,
        # the experts see a micro-batch's routed rows (under expert parallelism about as many,
        # from the group's ranks, over its experts)
        experts=shape.moe.num_experts // topo.expert if shape.moe else 0,
        expert_ffn=shape.moe.expert_width(shape.ffn_hidden_size) if shape.moe else 0,
        top_k=shape.moe.top_k if shape.moe else 0)
