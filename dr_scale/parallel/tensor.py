"""Tensor parallelism through DeepSpeed AutoTP, with the partition plan of each model family
(its ModelSpec.tp_plan).

The plan names the model's linears by pattern: Megatron-style column-parallel for the projections
that fan out (q, k, v, gate, up, fc_in) and row-parallel for those that write back into the
residual stream (o, down, fc_out), one all-reduce per attention and per MLP block. With
`parallel.vocab_parallel` (the default) the LM head is split by vocabulary rows, the embedding
tied to it shares that slice, and the loss is the fused chunked loss over the slice
(models/lm_head.py fuse_vocab_parallel_head; with model.loss_chunk_tokens=0, DeepSpeed's
vocabulary-parallel cross-entropy on the slice's logits, installed as the model's
`loss_function`): no rank holds the whole (tokens x vocabulary) logits.
An untied input embedding and the norms stay replicated. The model itself is untouched:
attention infers its local head count from the projection's output width.

AutoTP is applied here, before deepspeed.initialize, to a model built on the meta device, so
that a rank only ever makes its own slices real (parallel/sharded_build.py). Under pipeline
parallelism the engine could not apply it anyway (it builds its tensor groups as a (data, tensor)
mesh of the whole world): `shard_pipeline_layer` splits each layer of this rank's stage over the
pipeline grid's tensor group as the stage is built.

Why AutoTP rather than megatron-core's tensor_parallel layers: both give the dense block's
outputs and gradients (max error 2.2e-07 in fp32), and benchmarks/tp_backends.py, a Llama MLP
block (h 1024, f 2816, 2048 tokens) forward + backward on 2 CPU ranks, measured AutoTP at 422-476
ms against megatron-core's 633-648 ms (dense on one rank: 1216-1234 ms; 2026-11-30, 2-core CI
machine). AutoTP also needs no model rewrite (a plan of name patterns), works with ZeRO-1/2/3 and
DeepSpeed's checkpoints, and megatron-core's layers want its CUDA RNG tracker for initialization.
"""
from dr_scale.errors import DrScaleError
from dr_scale.models.build import spec_of
from dr_scale.models.lm_head import fuse_vocab_parallel_head


def check_divisible(shape, tp: int):
    for key, value in (("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads),
                       ("ffn_hidden_size", shape.ffn_hidden_size)):
        if value % tp:
            raise DrScaleError(f"parallel.tensor_parallel={tp} does not divide model.{key}={value}")


def autotp_section(shape, tp: int, vocab_parallel: bool = False) -> dict:
    """The DeepSpeed `tensor_parallel` config section for this model and TP size (the plan is
    the family's ModelSpec.tp_plan)."""
    plan = spec_of(shape.arch).tp_plan
    if not plan:
        raise DrScaleError(f"parallel.tensor_parallel: model arch '{shape.arch}' has no "
                           f"tensor-parallel plan")
    if vocab_parallel and shape.vocab_size < tp:
        raise DrScaleError(f"parallel.vocab_parallel: model.vocab_size={shape.vocab_size} is "
                           f"smaller than tensor_parallel={tp}")
    section = {"autotp_size": tp,
               "partition_config": {"use_default_specs": False,
                                    "layer_specs": [dict(spec) for spec in plan]}}
    if vocab_parallel:
        section["vocab_parallel_lm_head"] = True
    return section


def shard_model(model, shape, topo, section: dict, vocab_parallel: bool):
    """Partition the model's linears by its plan over the Topology's tensor group (DeepSpeed's
    (data, tensor) mesh, made by `Topology.with_groups`) before deepspeed.initialize, as the engine would inside
    it: on a model built on the meta device only this rank's slices are ever made real
    (parallel/sharded_build.py); `section`: `autotp_section`'s, made once in the plan. The engine then finds the model partitioned (DeepSpeed's
    `ds_autotp_parsed` mark) and keeps the rest of its tensor-parallel setup."""
    from deepspeed.module_inject.layers import (VocabParallelLinear,
                                                collect_autotp_universal_checkpoint_info)
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.sequence.cross_entropy import configure_vocab_parallel_loss

    tp = topo.tensor
    _autotp(model, section, tp, topo.tensor_group)
    heads = [m for m in model.modules() if isinstance(m, VocabParallelLinear)]
    if vocab_parallel:
        if len(heads) != 1:  # the plan names one head; DeepSpeed's loss needs exactly one
            raise RuntimeError(f"vocab_parallel: {len(heads)} vocabulary-parallel heads")
        configure_vocab_parallel_loss(model, heads[0], backend="torch")  # the logits path
        chunk = shape.loss_chunk_for(max(heads[0]._partition_sizes))
        if chunk:
            fuse_vocab_parallel_head(heads[0], chunk)
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(model))
    model.ds_autotp_parsed = True


def shard_pipeline_layer(layer, shape, tp: int, group):
    """Partition the linears of one layer of this rank's pipeline stage by the model's plan,
    over the tensor group of the pipeline grid (the ranks of one stage and one data-parallel
    replica)."""
    # DeepSpeed's engine cannot apply AutoTP to a pipeline (it would read its global (data,
    # tensor) mesh, which a pipeline does not use), so this is the only place it happens.
    _autotp(layer, autotp_section(shape, tp), tp, group)


def _autotp(module, section: dict, tp: int, group):
    """DeepSpeed's AutoTP with our plan, in training mode, over `group`."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.layers import set_autotp_mode
    from torch import nn

    plan = AutoTPConfig.from_dict(section["partition_config"])
    plan.tp_size = tp
    autotp = AutoTP(module=module, all_reduce_linears=(), prefix="", state_dict=None,
                    linear_layer_setting=(nn.Linear, nn.Embedding), orig_layer_impl=None,
                    partition_config=plan, training_mode=True,
                    vocab_parallel_lm_head=section.get("vocab_parallel_lm_head", False))
    # Outside training mode AutoTP takes the group it is given; in training mode it would read
    # DeepSpeed's global (data, tensor) mesh instead, which a pipeline does not use (and the
    # mode is global: the previous layer of a stage left it on).
    set_autotp_mode(training=False)
    autotp.set_tensor_parallel_config(tp, group)
    set_autotp_mode(training=True)
    autotp.update_linear_policies()
    autotp._replace_module(module)
    autotp.register_replicated_grad_hooks(module)
