"""DeepSpeed's Muon (deepspeed/runtime/zero/muon) for dr_scale's models.

Which parameters Muon steps: the blocks' weight matrices (attention and MLP projections; each
expert's matrices, orthogonalised one expert at a time). AdamW steps the rest: the embeddings
(tokens, GPT-2's learned positions), the LM head, the MoE router, norms and biases.
DeepSpeed's own tagging (`deepspeed.set_optimizer_flags`) decides by name (2-D and neither
"embed" nor "lm_head" in it), which would give GPT-2's position table `wpe` and the router to
Muon; so dr_scale tags by module type here and builds DeepSpeed's `MuonWithAuxAdam` itself, as
the client optimizer (ZeRO 1/2/3 recognise the class and run their Muon paths on it).

Tensor parallelism: a rank holds a slice of each split matrix, and Newton-Schulz of a slice is
not the slice of the whole matrix's orthogonalisation. Each split matrix is marked with its
slicing (`TensorSlice`), and the update ZeRO calls (`original_muon.muon_update`, which its call
sites import at each call) is replaced by `_muon_update`: it gathers the gradient's and the
momentum's slices over the tensor group, runs DeepSpeed's own update on the whole matrix and
keeps this rank's slice: the step one rank would take, for an all-gather of each split matrix
per step (Megatron's "duplicated" tensor-parallel Muon). DeepSpeed's alternative, per-head
orthogonalisation, changes the optimizer itself and is refused (config/ds_config.check_muon).
"""
import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The dtype Newton-Schulz runs in. DeepSpeed's choice (ns_compute_dtype) is by method and
# accelerator only: fp16 for "gram", bf16 for "standard", on a CPU too. In an fp32 run that
# rounding is the largest difference between layouts: the tiny model's losses on 2 data-parallel
# ranks came 2.6e-5 from one rank's at step 4 (Newton-Schulz in fp16) where every other sum agrees
# to 1e-6. optimizer.params.ns_dtype "auto" is therefore fp32 in an fp32 run, "deepspeed" (its
# choice) in a bf16 or fp16 one (config/ds_config.fill settles it); "fp32", "bf16", "fp16"
# force one.
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TensorSlice:
    """How a parameter is split over the tensor-parallel group: along `dim`, in rank order."""
    group: Any
    dim: int
    size: int

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        from dr_scale.runtime import comm

        parts = [torch.empty_like(t) for _ in range(self.size)]
        comm.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        rank = dist.get_rank(group=self.group)
        return whole.chunk(self.size, dim=self.dim)[rank]

    def __bool__(self):  # where DeepSpeed reads it as is_expert_group: truthy, as a mark
        return True


def _layer_ndim(p) -> int:
    return len(getattr(p, "ds_shape", p.shape))  # ZeRO-3's zero.Init leaves 1-D placeholders


def _adam_modules():
    from deepspeed.module_inject.layers import (HiddenParallelEmbedding, VocabParallelEmbedding,
                                                VocabParallelLinear)

    from dr_scale.models.lm_head import LMHead
    from dr_scale.models.moe import Router
    from dr_scale.parallel.pipeline import EmbeddingStage
    return (nn.Embedding, EmbeddingStage, LMHead, Router, VocabParallelLinear,
            VocabParallelEmbedding, HiddenParallelEmbedding)


def _slicing(module, tensor_group):
    """The TensorSlice of a module AutoTP split (column-parallel: output rows; row-parallel:
    input columns), else None."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    if tensor_group is None:
        return None
    import torch.distributed as dist

    size = dist.get_world_size(group=tensor_group)
    if size == 1:
        return None
    if isinstance(module, LinearAllreduce):
        return TensorSlice(tensor_group, 1, size)
    if isinstance(module, LinearLayer):
        return TensorSlice(tensor_group, 0, size)
    return None


def tag(model: nn.Module, tensor_group=None):
    """Mark every parameter `use_muon` (DeepSpeed's flag) by what its module is; each expert
    stack `is_expert_group` (batched, one Newton-Schulz per expert); a tensor-parallel slice
    with its TensorSlice, under both names DeepSpeed's call sites pass on (`is_expert_group`,
    `muon_num_heads`)."""
    from dr_scale.models.moe import Experts

    adam_only = _adam_modules()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            p.use_muon = _layer_ndim(p) >= 2 and not isinstance(module, adam_only)
            if isinstance(module, Experts):
                p.is_expert_group = True
                continue
            slicing = _slicing(module, tensor_group) if p.use_muon else None
            if slicing is not None:
                p.is_expert_group = slicing
                p.muon_num_heads = slicing


def sorted_for_muon(params):
    """MuonWithAuxAdam sorts its groups' parameters by size, largest first (a stable sort);
    sorting here by the layer's shape first makes the order the same on every build path (a
    ZeRO-3 placeholder's size is not its shape), and one that export/consolidate.py can rebuild."""
    return sorted(params, key=lambda p: tuple(getattr(p, "ds_shape", p.shape)), reverse=True)


def build(groups: list, params: dict):
    """DeepSpeed's MuonWithAuxAdam over `groups` (parallel.optimizer_groups.param_groups with
    `muon` settings), its AdamW half torch's AdamW (the optimizer of AdamW runs here, so the
    two halves of a comparison differ by Muon only)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    global _ns_dtype
    install_update()
    _ns_dtype = NS_DTYPES.get(params["ns_dtype"])  # "deepspeed": None
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW,
                           adam_optimizer_kwargs={"lr": params["lr"],
                                                  "betas": tuple(params["betas"]),
                                                  "eps": params["eps"]})


def group_settings(params: dict, use_muon: bool) -> dict:
    """A Muon or AdamW half's keys (DeepSpeed's `_MUON_HALF_KEYS`, `_ADAM_HALF_KEYS`)."""
    if use_muon:
        return {"use_muon": True, "lr": params["muon_lr"], "momentum": params["momentum"],
                "ns_method": params.get("ns_method", "gram")}
    return {"use_muon": False, "lr": params["lr"], "betas": tuple(params["betas"]),
            "eps": params["eps"]}


_original = _original_dtype = _ns_dtype = None


def install_update():
    """Replace DeepSpeed's muon_update by `_muon_update` and its Newton-Schulz dtype by
    `_compute_dtype` (once; see the module's text)."""
    global _original, _original_dtype
    from deepspeed.runtime.zero.muon import original_muon

    if _original is None:
        _original, _original_dtype = original_muon.muon_update, original_muon.ns_compute_dtype
        original_muon.muon_update = _muon_update
        original_muon.ns_compute_dtype = _compute_dtype


def _compute_dtype(ns_method: str = "gram") -> torch.dtype:
    return _ns_dtype or _original_dtype(ns_method)


def _eager_on_cpu(t: torch.Tensor):
    # DeepSpeed compiles its update; on a CPU inductor's C++ build of it costs about 70 s at a
    # rank's start (the tiny model: 85 s for 6 steps against 12 s eager), more than the update
    # saves in any run a CPU trains.
    if t.device.type == "cpu":
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def _muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram",
                 is_expert_group=False, num_heads=None):
    slicing = next((m for m in (is_expert_group, num_heads) if isinstance(m, TensorSlice)), None)
    with _eager_on_cpu(grad):
        if slicing is None:
            return _original(grad, momentum, beta, ns_steps, nesterov, ns_method,
                             is_expert_group, num_heads)
        whole_grad, whole_momentum = slicing.gather(grad), slicing.gather(momentum)
        update = _original(whole_grad, whole_momentum, beta, ns_steps, nesterov, ns_method,
                           False, None)
    momentum.copy_(slicing.mine(whole_momentum))
    grad.copy_(slicing.mine(whole_grad))  # DeepSpeed's update blends the gradient in place
    return slicing.mine(update).contiguous()
