"""Data x tensor x pipeline layout of the ranks.

Ranks are laid out (pipeline, data, tensor) with tensor the fastest-varying, as DeepSpeed's
PipeModelDataParallelTopology and its AutoTP mesh (data, tensor) lay them out: the ranks of one
tensor-parallel group are consecutive (one node holds a group when ranks per node is a multiple
of the TP size), and each pipeline stage is a contiguous block of ranks.
"""
from dataclasses import dataclass

from dr_scale.errors import DrScaleError


@dataclass(frozen=True)
class Topology:
    world: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self):
        for key, v in (("tensor_parallel", self.tensor), ("pipeline_parallel", self.pipeline)):
            if v < 1:
                raise DrScaleError(f"parallel.{key}={v}: expected an integer >= 1")
        if self.world % (self.tensor * self.pipeline):
            raise DrScaleError(
                f"parallel: tensor_parallel={self.tensor} x pipeline_parallel={self.pipeline} does "
                f"not divide the world of {self.world} ranks; data parallel is the rest, so the "
                f"world must be a multiple of {self.tensor * self.pipeline}")

    @property
    def data(self) -> int:
        return self.world // (self.tensor * self.pipeline)

    def coords(self, rank: int) -> dict:
        return {"pipeline": rank // (self.data * self.tensor),
                "data": (rank // self.tensor) % self.data,
                "tensor": rank % self.tensor}

    def describe(self) -> str:
        return (f"DP {self.data} x TP {self.tensor} x PP {self.pipeline} = {self.world} rank(s)")
