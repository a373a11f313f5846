"""Pipeline parallelism: a Llama-style model built on the meta device cut into a DeepSpeed
PipelineModule, each rank making real only its own stage's layers.

The stages reuse the built model's modules and parameters: each layer of this rank's stage is
split into its tensor-parallel slices (AutoTP, over the pipeline grid's tensor group) and then
given its values (parallel/sharded_build.materialize) as DeepSpeed builds it; the other stages'
layers stay on meta. A pipelined run starts from the same weights as an unpipelined one with the
same seed. Layers: the token embedding, one entry per decoder block, the final norm, the LM head
(tied to the embedding through DeepSpeed's TiedLayerSpec when the model ties them, so the two
stages holding it sum their gradients). Partitioned by parameter count; DeepSpeed's pipeline
engine runs the 1F1B schedule over the step's micro-batches (gradient_accumulation_steps of
them).

Parameter names inside a PipelineModule are its layer indices, not the model's; the export maps
its per-layer checkpoint files back to the model's names (export/checkpoint_source.py).
"""
import torch
import torch.nn.functional as F
from deepspeed.checkpoint.constants import (PIPELINE_REPLICATED_PARAMETER_PATTERNS,
                                            UNIVERSAL_CHECKPOINT_INFO)
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops
from dr_scale.runtime import comm
from dr_scale.models.build import spec_of
from dr_scale.parallel.sharded_build import materialize
from dr_scale.parallel.tensor import shard_pipeline_layer


class EmbeddingStage(nn.Module):
    """The token embedding, built from the model's own weight (also the tied LM head's), plus
    learned positions and dropout where the family has them (GPT-2). With packed documents kept
    apart its input is (tokens, document ids, positions), and the ids and positions travel on
    beside the hidden states (data/documents.py)."""

    def __init__(self, weight: nn.Parameter, positions: nn.Module = None,
                 dropout: nn.Module = None):
        super().__init__()
        self.weight, self.positions, self.dropout = weight, positions, dropout

    def forward(self, inputs):
        packed = isinstance(inputs, tuple)
        input_ids, doc_ids, position_ids = inputs if packed else (inputs, None, None)
        x = F.embedding(input_ids, self.weight)
        if self.positions is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.positions(position_ids)
        if self.dropout is not None:
            x = self.dropout(x)
        return (x, doc_ids, position_ids) if packed else x


def tied_head(stage: EmbeddingStage, x):
    return F.linear(x, stage.weight)


class BlockStage(nn.Module):
    """One decoder block; the rotary tables, where the family has them, are buffers (no
    parameters), one copy per stage. Given (hidden, document ids, positions) it applies what
    `mask` and `reset_positions` ask and passes the ids and positions on, except from the last
    block (the final norm takes hidden states only)."""

    def __init__(self, block: nn.Module, rotary: nn.Module = None, mask=False,
                 reset_positions=False, last=False):
        super().__init__()
        self.block, self.rotary = block, rotary
        self.mask, self.reset_positions, self.last = mask, reset_positions, last

    def forward(self, inputs):
        packed = isinstance(inputs, tuple)
        x, doc_ids, position_ids = inputs if packed else (inputs, None, None)
        mask = doc_ids if self.mask else None
        if self.rotary is None:
            out = self.block(x, doc_ids=mask)
        else:
            rotary = self.rotary(x.shape[1], position_ids if self.reset_positions else None)
            out = self.block(x, rotary, mask)
        return out if self.last or not packed else (out, doc_ids, position_ids)


def pipeline_loss(logits, labels):
    return ops.cross_entropy(logits, labels)


def refusals(shape, stages: int):
    """The refusals of a pipelined layout, before anything is built (parallelize.refusals)."""
    if not spec_of(shape.arch).pipeline:
        raise DrScaleError(f"parallel.pipeline_parallel: model.arch {shape.arch} has no "
                           f"pipeline layout (its ModelSpec's `pipeline`)")
    if shape.num_layers < stages:
        raise DrScaleError(f"parallel.pipeline_parallel={stages} exceeds model.num_layers="
                           f"{shape.num_layers}: every stage needs a block")


def to_pipeline(model: nn.Module, shape, topo, checkpoint_every=0, document_mask=False,
                reset_positions=False, weights=None, dtype=None):
    """A PipelineModule over the Topology's stages built from `model` (on meta or real), cut
    where its family's PipelineLayout says, over the grid of the Topology's process groups;
    under tensor parallelism each stage's linears are split across the tensor group.
    `weights`: an init_from folder's (HFWeights), or None; `dtype`: the training precision the
    layers are made real in."""
    where = spec_of(shape.arch).pipeline
    part = lambda path: None if path is None else model.get_submodule(path)  # noqa: E731
    ready = _preparer(shape, topo, weights, dtype)
    embedding = EmbeddingStage(part(where.embedding).weight, part(where.positions),
                               part(where.dropout))
    if shape.tie_embeddings:
        embed = _BuiltTiedLayer("embed", embedding, ready)
        head = _BuiltTiedLayer("embed", embedding, ready, forward_fn=tied_head)
    else:
        embed = _BuiltLayer(embedding, ready)
        head = _BuiltLayer(model.lm_head, ready)
    blocks, rotary = part(where.blocks), part(where.rotary)
    layers = [embed, *(_BuiltLayer(BlockStage(b, rotary, document_mask, reset_positions,
                                              i == len(blocks) - 1), ready)
                       for i, b in enumerate(blocks)), _BuiltLayer(part(where.norm), ready),
              head]
    pipe = _PipelineOfBuiltLayers(layers=layers, loss_fn=pipeline_loss,
                                  topology=topo.groups.pipe_topology,
                                  partition_method="parameters",
                                  activation_checkpoint_interval=checkpoint_every)
    pipe.shape = shape  # the trainer and checkpoints read the model's shape from the module
    setattr(pipe, UNIVERSAL_CHECKPOINT_INFO, _conversion_record(pipe, shape, topo))
    return pipe


def _conversion_record(pipe: PipelineModule, shape, topo) -> dict:
    """What DeepSpeed's universal conversion needs to know of the pipeline's parameters, for
    every stage (each checkpoint file carries one record, each stage knows its own layers):
    - under tensor parallelism, AutoTP's record of which slices are row-parallel, replicated or
      cut by vocabulary (DeepSpeed's engine makes it only for a module it partitions itself);
    - with tied embeddings, that the first stage's copy of the tied layer is the one to take:
      the tied layer lives on the first and the last stage, and only its `weight` has its
      gradients summed between them, so a learned-positions table in it (GPT-2's) trains on the
      first stage alone and the last one's copy drifts."""
    record = {}
    if topo.sliced:
        from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info

        for stage_record in comm.all_gather_object(collect_autotp_universal_checkpoint_info(pipe)):
            for key, value in stage_record.items():
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    record[key] = sorted(set(record.get(key, [])) | set(value))
                elif isinstance(value, list):  # records of a stage's parameters
                    record[key] = record.get(key, []) + value
                elif isinstance(value, dict):
                    record[key] = {**record.get(key, {}), **value}
                else:
                    record.setdefault(key, value)
    if shape.tie_embeddings:
        record[PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [r"^tied_modules\."]
    return record


def _preparer(shape, topo, weights, dtype):
    """What makes a layer of this rank's stage ready: its tensor-parallel slices (over the
    Topology's tensor group), then real values (the initial ones, or `weights`'s)."""
    def ready(layer: nn.Module):
        if topo.sliced:
            shard_pipeline_layer(layer, shape, topo.tensor, topo.tensor_group)
        materialize(layer, weights, dtype)

    return ready


class _BuiltLayer(LayerSpec):
    """A layer built already (on meta): DeepSpeed builds the layers of this rank's stage only,
    and building one here makes it ready for this rank instead of constructing it."""

    def __init__(self, module: nn.Module, ready):
        super().__init__(type(module))
        self.module, self.ready = module, ready

    def build(self, log=False):
        self.ready(self.module)
        return self.module


class _BuiltTiedLayer(TiedLayerSpec):
    """As _BuiltLayer, for the embedding tied to the LM head (its stages sum their gradients)."""

    def __init__(self, key: str, module: nn.Module, ready, forward_fn=None):
        super().__init__(key, type(module), forward_fn=forward_fn)
        self.module, self.ready = module, ready

    def build(self, log=False):
        self.ready(self.module)
        return self.module


class _PipelineOfBuiltLayers(PipelineModule):
    def _count_layer_params(self):
        """Balancing stages by parameters, DeepSpeed builds every layer once to count it; these
        are counted as they are, on meta, without being made real."""
        return [sum(p.numel() for p in spec.module.parameters() if p.requires_grad)
                for spec in self._layer_specs]
