"""Activation checkpointing applied to a built model without changing its parameter names:
the chosen modules' forward methods are wrapped so their activations are recomputed in the
backward pass instead of kept.

    none       keep everything
    full       every k-th decoder block (parallel.checkpoint_every = k) keeps only its input
    selective  only the attention of every k-th block (cheap to recompute, large to keep at
               long sequences without flash attention)

Recomputation goes through DeepSpeed's checkpointing (non-reentrant form); its RNG handling
makes recomputed dropout masks equal to the first pass. The DeepSpeed config's
`activation_checkpointing.partition_activations` and `cpu_checkpointing` are refused at start:
with DeepSpeed 0.19.8's non-reentrant form both fail in the backward pass on these blocks
(measured: partitioned inputs do not gather back, "shape '[256, 32]' is invalid for input of
size 1", even on one rank; host copies come back in fp32 beside bf16 weights, "expected m1 and m2
to have the same dtype").
"""
import functools

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

    leaves, spec = tree_flatten((args, kwargs))  # tuples (rotary tables) become plain arguments

    def run(*flat):
        a, kw = tree_unflatten(list(flat), spec)
        return forward(*a, **kw)
    return deepspeed.checkpointing.non_reentrant_checkpoint(run, *leaves)


def apply(model: nn.Module, mode: str, every: int = 1, ds_config: dict = None, mpu=None,
          source: str = "the DeepSpeed config") -> int:
    """Wrap the modules `mode` names; returns how many were wrapped."""
    if mode == "none":
        return 0
    import deepspeed

    section = (ds_config or {}).get("activation_checkpointing", {})
    for key in ("partition_activations", "cpu_checkpointing"):
        if section.get(key):
            raise DrScaleError(f"{source}: activation_checkpointing.{key}=true: DeepSpeed's "
                               f"non-reentrant checkpointing fails with it in the backward pass; "
                               f"set it to false (parallel.activation_checkpointing still applies)")
    deepspeed.checkpointing.configure(mpu, partition_activations=False, checkpoint_in_cpu=False,
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
    if zero_stage == 3:
        raise DrScaleError("model.compile=true with ZeRO-3: DeepSpeed's parameter gathering hooks "
                           "break the compiled graphs; use ZeRO-0/1/2 or model.compile=false")
    if checkpointing != "none":
        raise DrScaleError("model.compile=true with parallel.activation_checkpointing: not "
                           "combined yet; choose one")
    blocks = decoder_blocks(model)
    for b in blocks:
        b.compile()
    return len(blocks)
