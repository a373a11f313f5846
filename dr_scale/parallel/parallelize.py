"""parallelize(): every parallel dimension applied around the plain model, in one visible order,
with the refusals beside them.

    1. refusals           what DeepSpeed or our wrappers cannot combine (one line each)
    2. tensor parallel    without a pipeline: the linears split by AutoTP over DeepSpeed's
                          (data, tensor) mesh (also used by partitioned activation
                          checkpointing), and the AutoTP section of the DeepSpeed config
    3. checkpointing      activation checkpointing of decoder blocks or their attention
    4. compile            torch.compile of each decoder block
    5. ZeRO-3 gathering   each decoder block gathered as one unit (parallel.zero3_gather)
    6. pipeline           the model cut into DeepSpeed pipeline stages; under TP each stage's
                          linears split over the pipeline grid's tensor group; without one,
                          this rank's slice of the experts (expert parallel) kept, then what
                          this rank keeps of a model built on meta made real
    7. sequence parallel  after deepspeed.initialize: `Parallelized.after_engine`

Under tensor or pipeline parallelism the model arrives here on the meta device, and only what
this rank keeps of it is made real (parallel/sharded_build.materialize).
"""
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.parallel import checkpointing, expert, sequence, zero3_gather
from dr_scale.parallel import pipeline
from dr_scale.parallel.pipeline import to_pipeline
from dr_scale.parallel.sharded_build import materialize, zero3_partitioner
from dr_scale.parallel.tensor import check_divisible, shard_model
from dr_scale.parallel.topology import Topology


@dataclass
class Parallelized:
    model: nn.Module           # the plain model, or a PipelineModule of its stages
    ds: dict                   # the DeepSpeed config, its tensor_parallel section added under TP
    mpu: Optional[Any] = None  # DeepSpeed's (data, tensor) mesh under AutoTP (Topology.groups)
    sequence_parallel: bool = False

    def after_engine(self, engine):
        if self.sequence_parallel:
            sequence.apply(engine.module, engine.module.shape.arch)


def refusals(shape, topo: Topology, cfg, deepspeed) -> None:
    """Every refusal, before anything is built: dr_scale/plan.py runs it before the process
    group starts (`deepspeed`: its config/ds_config.DeepSpeedView)."""
    p, zero, ds_path = cfg.parallel, deepspeed.stage, deepspeed.source
    if topo.pipeline > 1:
        pipeline.refusals(shape, topo.pipeline)
    if topo.pipeline > 1 and zero >= 2:
        raise DrScaleError(f"{ds_path}: zero_optimization.stage={zero} with "
                           f"parallel.pipeline_parallel={topo.pipeline}: DeepSpeed's pipeline engine "
                           f"supports ZeRO-0/1 only; use zero1 (or pipeline_parallel=1 with ZeRO-3)")
    if topo.tensor > 1:
        check_divisible(shape, topo.tensor)
    if p.sequence_parallel:
        sequence.refusals(shape, topo.tensor, cfg.data.seq_length, p.vocab_parallel, topo.pipeline)
    if p.activation_checkpointing != "none":
        checkpointing.refusals(deepspeed.filled, source=ds_path)
    if cfg.model.compile is True:
        checkpointing.compile_refusals(zero, p.activation_checkpointing)
    expert.refusals(shape, topo, zero, cfg.model.compile is True, ds_path)


def parallelize(model: nn.Module, shape, topo: Topology, cfg, ds: dict,
                weights=None, compiled: bool = None) -> Parallelized:
    """`ds`: the engine's DeepSpeed config (its `tensor_parallel` section, AutoTP's, made in the
    plan). `weights`: the init_from folder's (HFWeights) for a model built on meta, LOADED_LATER
    on a resume (zeros, the checkpoint's values come next), or None (the initial values).
    `compiled`: model.compile settled (parallel/compile_choice.py); None: model.compile=true."""
    p, stage = cfg.parallel, dsc.zero_stage(ds)
    dtype = dsc.torch_dtype(dsc.precision(ds))  # what a model built on meta is made real in
    mpu = None  # (1, the refusals: `refusals`, run once in the plan before the process group)
    if topo.autotp:                                                                  # 2
        shard_model(model, shape, topo, ds["tensor_parallel"], p.vocab_parallel)
        mpu = topo.groups.mpu  # DeepSpeed's batch check then counts data-parallel ranks only
    checkpointing.apply(model, p.activation_checkpointing, p.checkpoint_every, ds, mpu)  # 3
    if compiled is None:
        compiled = cfg.model.compile is True
    if compiled:                                                                       # 4
        checkpointing.compile_blocks(model, stage, p.activation_checkpointing)
    if stage == 3 and p.zero3_gather == "block":                          # 5
        zero3_gather.gather_by_block(model)
    if topo.pipelined:                                                                 # 6
        model = to_pipeline(model, shape, topo, document_mask=cfg.data.document_mask,
                            reset_positions=cfg.data.reset_positions, weights=weights,
                            dtype=dtype)
    else:  # (a pipeline makes its layers real as it builds them)
        partition = None
        if topo.sliced and stage == 3:
            partition = zero3_partitioner(ds, topo.groups.mpu)
        if topo.experts_split:  # this rank's slice of each block's experts
            expert.split_experts(model, topo)
        materialize(model, weights, dtype, partition)
    return Parallelized(model, ds, mpu, sequence_parallel=p.sequence_parallel)       # 7
