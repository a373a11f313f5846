"""Pipeline parallelism: a built Llama-style model cut into a DeepSpeed PipelineModule.

The stages reuse the built model's modules and parameters, so a pipelined run starts from the
same weights as an unpipelined one with the same seed. Layers: the token embedding, one entry per
decoder block, the final norm, the LM head (tied to the embedding through DeepSpeed's
TiedLayerSpec when the model ties them, so the two stages holding it sum their gradients).
Partitioned by parameter count; DeepSpeed's pipeline engine runs the 1F1B schedule over the
step's micro-batches (gradient_accumulation_steps of them).

Parameter names inside a PipelineModule are its layer indices, not the model's: exporting a
pipelined run to Hugging Face format is not supported yet.
"""
import torch.nn.functional as F
from torch import nn

from dr_scale.errors import DrScaleError
from dr_scale.models.build import spec_of
from dr_scale.kernels import ops


class EmbeddingStage(nn.Module):
    """The token embedding; built from the model's own weight (also the tied LM head's). With
    packed documents kept apart its input is (tokens, document ids, positions), and the ids and
    positions travel on beside the hidden states (data/documents.py)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            input_ids, doc_ids, position_ids = inputs
            return F.embedding(input_ids, self.weight), doc_ids, position_ids
        return F.embedding(inputs, self.weight)


def tied_head(stage: EmbeddingStage, x):
    return F.linear(x, stage.weight)


class BlockStage(nn.Module):
    """One decoder block; the rotary tables are buffers (no parameters), one copy per stage.
    Given (hidden, document ids, positions) it applies what `mask` and `reset_positions` ask and
    passes the ids and positions on, except from the last block (the final norm takes hidden
    states only)."""

    def __init__(self, block: nn.Module, rotary: nn.Module, mask=False, reset_positions=False,
                 last=False):
        super().__init__()
        self.block, self.rotary = block, rotary
        self.mask, self.reset_positions, self.last = mask, reset_positions, last

    def forward(self, inputs):
        if not isinstance(inputs, tuple):
            return self.block(inputs, self.rotary(inputs.shape[1]))
        x, doc_ids, position_ids = inputs
        rotary = self.rotary(x.shape[1], position_ids if self.reset_positions else None)
        out = self.block(x, rotary, doc_ids if self.mask else None)
        return out if self.last else (out, doc_ids, position_ids)


def pipeline_loss(logits, labels):
    return ops.cross_entropy(logits, labels)


def to_pipeline(model: nn.Module, shape, stages: int, data_parallel: int, tensor_parallel=1,
                checkpoint_every=0, document_mask=False, reset_positions=False):
    """A PipelineModule over `stages` stages built from `model` (a LlamaForCausalLM); with
    tensor_parallel > 1 its grid holds the tensor groups (parallel.tensor.shard_pipeline_stages
    then splits each stage's linears)."""
    from deepspeed.pipe import PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if not spec_of(shape.arch).pipeline:
        raise DrScaleError(f"parallel.pipeline_parallel: pipeline stages are built for the "
                           f"Llama layout; model.arch {shape.arch} does not have it")
    if shape.num_layers < stages:
        raise DrScaleError(f"parallel.pipeline_parallel={stages} exceeds model.num_layers="
                           f"{shape.num_layers}: every stage needs a block")
    body = model.model
    if shape.tie_embeddings:
        embed = TiedLayerSpec("embed", EmbeddingStage, body.embed_tokens.weight)
        head = TiedLayerSpec("embed", EmbeddingStage, body.embed_tokens.weight,
                             forward_fn=tied_head)
    else:
        embed, head = EmbeddingStage(body.embed_tokens.weight), model.lm_head
    last = len(body.layers) - 1
    layers = [embed, *(BlockStage(b, body.rotary, document_mask, reset_positions, i == last)
                       for i, b in enumerate(body.layers)), body.norm, head]
    topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor_parallel,
                                          num_dp=data_parallel)
    pipe = PipelineModule(layers=layers, loss_fn=pipeline_loss, topology=topo,
                          partition_method="parameters",
                          activation_checkpoint_interval=checkpoint_every)
    pipe.shape = shape  # the trainer and checkpoints read the model's shape from the module
    return pipe
