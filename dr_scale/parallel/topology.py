"""Data x tensor x pipeline layout of the ranks, built once at start and passed to everything
that needs a size or this rank's place; nobody re-derives them from the config, the engine or
file names.

Ranks are laid out (pipeline, data, tensor) with tensor the fastest-varying, as DeepSpeed's
PipeModelDataParallelTopology and its AutoTP mesh (data, tensor) lay them out: the ranks of one
tensor-parallel group are consecutive (one node holds a group when ranks per node is a multiple
of the TP size), and each pipeline stage is a contiguous block of ranks. Sequence parallelism
splits the sequence over the tensor group, so it adds no dimension of its own.
"""
from dataclasses import dataclass

from dr_scale.errors import DrScaleError


@dataclass(frozen=True)
class Topology:
    world: int
    tensor: int = 1
    pipeline: int = 1
    rank: int = 0                    # this process's global rank
    sequence_parallel: bool = False  # the sequence split over the tensor group

    def __post_init__(self):
        for key, v in (("tensor_parallel", self.tensor), ("pipeline_parallel", self.pipeline)):
            if v < 1:
                raise DrScaleError(f"parallel.{key}={v}: expected an integer >= 1")
        if self.world % (self.tensor * self.pipeline):
            raise DrScaleError(
                f"parallel: tensor_parallel={self.tensor} x pipeline_parallel={self.pipeline} does "
                f"not divide the world of {self.world} ranks; data parallel is the rest, so the "
                f"world must be a multiple of {self.tensor * self.pipeline}")

    @classmethod
    def from_config(cls, world: int, parallel_cfg, rank: int = 0) -> "Topology":
        return cls(world, parallel_cfg.tensor_parallel, parallel_cfg.pipeline_parallel, rank,
                   parallel_cfg.sequence_parallel)

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

    def head_slices(self, vocab_parallel: bool) -> int:
        """Vocabulary slices of the LM head: the tensor group's size when parallel.vocab_parallel
        applies (tensor parallel without pipeline stages, which keep the head whole), else 1."""
        return self.tensor if vocab_parallel and self.tensor > 1 and self.pipeline == 1 else 1

    def describe(self) -> str:
        return f"DP {self.data} x TP {self.tensor} x PP {self.pipeline} = {self.world} rank(s)"
