"""Activation checkpointing applied to a built model without changing its parameter names:
the chosen modules' forward methods are wrapped so their activations are recomputed in the
backward pass instead of kept.

    none       keep everything
    full       every k-th decoder block (parallel.checkpoint_every = k) keeps only its input
    selective  only the attention of every k-th block (cheap to recompute, large to keep at
               long sequences without flash attention)

Recomputation goes through DeepSpeed's checkpointing (non-reentrant form); its RNG handling
makes recomputed dropout masks equal to the first pass, and the DeepSpeed config's
`activation_checkpointing.partition_activations` splits the kept block inputs across the tensor
group. Its `cpu_checkpointing` is refused at start: with DeepSpeed 0.19.8 the recomputed block
got an fp32 input beside bf16 weights ("expected m1 and m2 to have the same dtype"); not traced
further.
"""
import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dr_scale.errors import DrScaleError
from dr_scale.models.layers import SelfAttention


def decoder_blocks(model: nn.Module):
    """The modules that directly own an attention layer: the decoder blocks, in order."""
    return [m for m in model.modules()
            if any(isinstance(c, SelfAttention) for c in m.children())]


def _checkpointed(forward, *args, **kwargs):
    import deepspeed

    leaves, spec = tree_flatten((args, kwargs))
    # Only activations (tensors that carry gradients) go through the checkpoint; constants such as
    # the rotary tables are closed over: DeepSpeed's partitioned and CPU checkpointing pair each
    # argument with its saved size and mis-pair them when constants are among the arguments.
    slots = [i for i, v in enumerate(leaves) if torch.is_tensor(v) and v.requires_grad]

    def run(*activations):
        flat = list(leaves)
        for i, v in zip(slots, activations):
            flat[i] = v
        a, kw = tree_unflatten(flat, spec)
        return forward(*a, **kw)
    return deepspeed.checkpointing.non_reentrant_checkpoint(run, *[leaves[i] for i in slots])


def check(ds_config: dict, source: str = "the DeepSpeed config"):
    """Refuse what our checkpointing cannot run with (before anything is built)."""
    if (ds_config or {}).get("activation_checkpointing", {}).get("cpu_checkpointing"):
        raise DrScaleError(f"{source}: activation_checkpointing.cpu_checkpointing=true: DeepSpeed's "
                           f"non-reentrant checkpointing fails with it in the backward pass; set "
                           f"it to false (parallel.activation_checkpointing still applies)")


def check_compile(zero_stage: int, checkpointing: str):
    if zero_stage == 3:
        raise DrScaleError("model.compile=true with ZeRO-3: DeepSpeed's parameter gathering hooks "
                           "break the compiled graphs; use ZeRO-0/1/2 or model.compile=false")
    if checkpointing != "none":
        raise DrScaleError("model.compile=true with parallel.activation_checkpointing: not "
                           "combined yet; choose one")


def apply(model: nn.Module, mode: str, every: int = 1, ds_config: dict = None, mpu=None,
          source: str = "the DeepSpeed config") -> int:
    """Wrap the modules `mode` names; returns how many were wrapped."""
    if mode == "none":
        return 0
    import deepspeed

    check(ds_config, source)
    section = (ds_config or {}).get("activation_checkpointing", {})
    deepspeed.checkpointing.configure(mpu,
                                      partition_activations=bool(section.get("partition_activations")),
                                      checkpoint_in_cpu=False,
                                      contiguous_checkpointing=False, synchronize=False,
                                      profile=False)
    blocks = decoder_blocks(model)[::every]
    targets = blocks if mode == "full" else [
        c for b in blocks for c in b.children() if isinstance(c, SelfAttention)]
    for m in targets:
        m.forward = functools.partial(_checkpointed, m.forward)
    return len(targets)


def compile_blocks(model: nn.Module, zero_stage: int, checkpointing: str) -> int:
    """torch.compile each decoder block in place (parameter names unchanged): one compiled
    region per block type, reused by every block, as torchtitan does; returns how many."""
    check_compile(zero_stage, checkpointing)
    blocks = decoder_blocks(model)
    for b in blocks:
        b.compile()
    return len(blocks)
