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
    """The token embedding; built from the model's own weight (also the tied LM head's)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)


def tied_head(stage: EmbeddingStage, x):
    return F.linear(x, stage.weight)


class BlockStage(nn.Module):
    """One decoder block; the rotary tables are buffers (no parameters), one copy per stage."""

    def __init__(self, block: nn.Module, rotary: nn.Module):
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, x):
        return self.block(x, self.rotary(x.shape[1]))


def pipeline_loss(logits, labels):
    return ops.cross_entropy(logits, labels)


def to_pipeline(model: nn.Module, shape, stages: int, data_parallel: int, tensor_parallel=1,
                checkpoint_every=0):
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
    layers = [embed, *(BlockStage(b, body.rotary) for b in body.layers), body.norm, head]
    topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor_parallel,
                                          num_dp=data_parallel)
    pipe = PipelineModule(layers=layers, loss_fn=pipeline_loss, topology=topo,
                          partition_method="parameters",
                          activation_checkpoint_interval=checkpoint_every)
    pipe.shape = shape  # the trainer and checkpoints read the model's shape from the module
    return pipe
