"""Data x tensor x pipeline layout of the ranks, built once at start and passed to everything
that needs a size or this rank's place; nobody re-derives them from the config, the engine or
file names.

Ranks are laid out (pipeline, data, tensor) with tensor the fastest-varying, as DeepSpeed's
PipeModelDataParallelTopology and its AutoTP mesh (data, tensor) lay them out: the ranks of one
tensor-parallel group are consecutive (one node holds a group when ranks per node is a multiple
of the TP size), and each pipeline stage is a contiguous block of ranks. Sequence parallelism
splits the sequence over the tensor group, so it adds no dimension of its own.

The plan holds a rank-less Topology (sizes and layout rules, `rank` 0); `start_group` makes this
rank's, with its process groups (`with_groups`): DeepSpeed's (data, tensor) mesh for AutoTP, or
the pipeline grid DeepSpeed's PipelineModule is built over, made once and handed to everything
that needs a group.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from dr_scale.errors import DrScaleError


@dataclass(frozen=True)
class Topology:
    world: int
    tensor: int = 1
    pipeline: int = 1
    rank: int = 0                    # this process's global rank
    expert: int = 1                  # ranks a block's experts are split over (within data)
    sequence_parallel: bool = False  # the sequence split over the tensor group
    groups: Optional["ProcessGroups"] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for key, v in (("tensor_parallel", self.tensor), ("pipeline_parallel", self.pipeline)):
            if v < 1:
                raise DrScaleError(f"parallel.{key}={v}: expected an integer >= 1")
        if self.world % (self.tensor * self.pipeline):
            raise DrScaleError(
                f"parallel: tensor_parallel={self.tensor} x pipeline_parallel={self.pipeline} does "
                f"not divide the world of {self.world} ranks; data parallel is the rest, so the "
                f"world must be a multiple of {self.tensor * self.pipeline}")
        if self.expert < 1 or self.data % self.expert:
            raise DrScaleError(
                f"parallel.expert_parallel={self.expert}: expected a divisor of the data-parallel "
                f"size {self.data} (the experts are split over data-parallel ranks, which hold "
                f"the other parameters whole)")

    @classmethod
    def from_config(cls, world: int, parallel_cfg, rank: int = 0) -> "Topology":
        return cls(world, parallel_cfg.tensor_parallel, parallel_cfg.pipeline_parallel, rank,
                   parallel_cfg.expert_parallel, parallel_cfg.sequence_parallel)

    def at_rank(self, rank: int) -> "Topology":
        """The same layout, seen from global rank `rank` (the process group's step)."""
        return dataclasses.replace(self, rank=rank)

    def with_world(self, world: int) -> "Topology":
        """The same layout over `world` ranks (the memory check's what-if: more ranks)."""
        return dataclasses.replace(self, world=world, rank=0, groups=None)

    @property
    def data(self) -> int:
        return self.world // (self.tensor * self.pipeline)

    def coords(self, rank: int = None) -> dict:
        """{pipeline, data, tensor} of `rank` (default: this process's)."""
        rank = self.rank if rank is None else rank
        return {"pipeline": rank // (self.data * self.tensor),
                "data": (rank // self.tensor) % self.data,
                "tensor": rank % self.tensor}

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this rank is: a tensor group reads the same batches."""
        return self.coords()["data"]

    @property
    def tensor_rank(self) -> int:
        return self.coords()["tensor"]

    @property
    def expert_rank(self) -> int:
        """Which slice of each block's experts this rank holds: consecutive data-parallel ranks
        form an expert-parallel group (DeepSpeed's expert/data layout)."""
        return self.data_rank % self.expert

    @property
    def experts_split(self) -> bool:
        return self.expert > 1

    @property
    def sliced(self) -> bool:
        """The linears are split over a tensor-parallel group."""
        return self.tensor > 1

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1

    @property
    def autotp(self) -> bool:
        """Tensor parallel by DeepSpeed's AutoTP over its (data, tensor) mesh: without pipeline
        stages (under them each stage's linears split over the pipeline grid's tensor group)."""
        return self.sliced and not self.pipelined

    @property
    def loss_in_model(self) -> bool:
        """The model's forward computes the fused chunked loss; a pipeline's last stage computes
        the logits, then DeepSpeed's loss function takes them."""
        return not self.pipelined

    @property
    def builds_on_meta(self) -> bool:
        """The model is built on the meta device and only this rank's slices of its stage are
        made real (parallel/sharded_build.py)."""
        return self.sliced or self.pipelined or self.experts_split

    def head_slices(self, vocab_parallel: bool) -> int:
        """Vocabulary slices of the LM head: the tensor group's size when parallel.vocab_parallel
        applies (tensor parallel without pipeline stages, which keep the head whole), else 1."""
        return self.tensor if vocab_parallel and self.autotp else 1

    def describe(self) -> str:
        ep = f" (EP {self.expert} within DP)" if self.experts_split else ""
        return (f"DP {self.data} x TP {self.tensor} x PP {self.pipeline} = {self.world} "
                f"rank(s){ep}")

    def with_groups(self) -> "Topology":
        """This rank's Topology with its process groups made (once, after the process group
        starts: every rank calls it, as making a group is collective)."""
        return dataclasses.replace(self, groups=ProcessGroups.make(self))

    @property
    def tensor_group(self):
        """This rank's tensor-parallel process group (None without tensor parallelism)."""
        return self.groups.tensor if self.groups is not None else None

    @property
    def expert_group(self):
        """This rank's expert-parallel process group (None without expert parallelism)."""
        return self.groups.expert if self.groups is not None else None

    @property
    def expert_data_group(self):
        """The ranks holding this rank's experts (None without expert parallelism)."""
        return self.groups.expert_data if self.groups is not None else None


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups beyond the world. DeepSpeed keeps AutoTP's (data, tensor) mesh
    in its module-global `deepspeed.utils.groups`, which its engine reads as the `mpu`; a
    pipeline's grid is made by its PipelineModule from `pipe_topology`, and its tensor groups are
    needed before that, while the stages' layers are split."""
    mpu: Any = None            # deepspeed.utils.groups with its mesh made (AutoTP), else None
    tensor: Any = None         # this rank's tensor-parallel group
    pipe_topology: Any = None  # DeepSpeed's PipeModelDataParallelTopology (pipelined)
    expert: Any = None         # this rank's expert-parallel group
    expert_data: Any = None    # the ranks holding the same experts as this one (their ZeRO
                               # partitions and gradient reduction; under TP, all tensor ranks)

    @classmethod
    def make(cls, topo: Topology) -> "ProcessGroups":
        made = cls()
        if topo.autotp:
            from deepspeed.utils import groups

            groups._init_tp_mesh_device(tensor_model_parallel_size=topo.tensor)
            made = cls(mpu=groups, tensor=groups.get_tensor_model_parallel_group())
        if topo.experts_split:  # (refused with pipeline parallelism: expert.py)
            from deepspeed.utils import groups

            # DeepSpeed's expert and expert-data groups, which its ZeRO-1/2 optimizer reduces
            # the experts' gradients over; its engine finds them by this name. Under tensor
            # parallelism an expert group joins the ranks of one tensor rank across data ranks
            # (TP-strided), and the expert-data group holds the tensor group's replicas too.
            groups._create_expert_and_data_parallel(expert_parallel_size_=topo.expert,
                                                    mp_size=topo.tensor, pp_size=1,
                                                    mp_mode="tp")
            name = f"ep_size_{topo.expert}"
            return dataclasses.replace(
                made, expert=groups._get_expert_parallel_group(name),
                expert_data=groups._get_expert_data_parallel_group(name))
        if topo.autotp:
            return made
        if topo.pipelined:
            from deepspeed.runtime.pipe.topology import (PipeModelDataParallelTopology,
                                                         PipelineParallelGrid)

            pipe = PipeModelDataParallelTopology(num_pp=topo.pipeline, num_mp=topo.tensor,
                                                 num_dp=topo.data)
            # The PipelineModule makes this grid again from the same topology (it takes no grid):
            # the same sets of ranks, so the tensor group made here is its slice group.
            tensor = (PipelineParallelGrid(topology=pipe).get_slice_parallel_group()
                      if topo.sliced else None)
            return cls(tensor=tensor, pipe_topology=pipe)
        return cls()
