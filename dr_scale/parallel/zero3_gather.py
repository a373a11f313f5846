"""ZeRO-3's unit of gathering (parallel.zero3_gather).

DeepSpeed's ZeRO-3 puts a gather hook before, and a release hook after, every module that owns
parameters: in a Llama block seven linears and two norms, each gathered on its own in the
forward, again in the backward, with Python bookkeeping at every hook. `block` marks each decoder
block as one of DeepSpeed's ZeRO-3 leaf modules instead (deepspeed.utils.set_z3_leaf_module, the
flag its MoE blocks use): the block's parameters are gathered together at its start and
released at its end, forward and backward, as FSDP wraps per block in torchtitan. The inside of
a block then holds no hook, so a compiled block is one graph.

Measured (tiny, 2 CPU ranks, ZeRO-3, bf16, one run each; docs/parallelism_and_memory.md): block
against module 1.10x tokens/s eager, 1.15x compiled. The cost: one block's 16-bit parameters are live at once
(llama_70b: 0.86B parameters, 1.6 GiB), which the memory estimate counts.
"""
from torch import nn

from dr_scale.models.layers import decoder_blocks


def gather_by_block(model: nn.Module) -> int:
    """Mark each decoder block a ZeRO-3 leaf (before deepspeed.initialize registers the hooks);
    returns how many."""
    from deepspeed.utils import set_z3_leaf_module

    blocks = decoder_blocks(model)
    for block in blocks:
        set_z3_leaf_module(block, True)
    return len(blocks)


def describe(mode: str) -> str:
    if mode == "block":
        return "ZeRO-3 gathers each decoder block's parameters at once (parallel.zero3_gather=block)"
    return "ZeRO-3 gathers each module's parameters (parallel.zero3_gather=module)"
