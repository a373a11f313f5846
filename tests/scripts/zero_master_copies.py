"""Run by tests/test_estimate.py on 2 ranks (torch.multiprocessing, gloo): real DeepSpeed engines
in fp32 under ZeRO-1, 2 and 3 with torch's AdamW, as the bundled configs make them; reports per
stage whether the optimizer's fp32 partition is a tensor of its own (a master copy) or the model's
own partition, and how many elements it holds."""
import os
import sys

import torch
import torch.multiprocessing as mp
from rank_result import write_and_leave


def master_partitions(optimizer, stage: int):
    """(the optimizer's fp32 partitions, the model's working partitions) of a ZeRO optimizer."""
    if stage == 3:
        return optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat
    import torch.distributed as dist

    rank = dist.get_rank()  # one data-parallel group: the world
    return (optimizer.single_partition_of_fp32_groups,
            [group[rank] for group in optimizer.parallel_partitioned_bit16_groups])


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed

    from dr_scale.config.schema import ModelConfig
    from dr_scale.models import resolve_shape
    from dr_scale.parallel.sharded_build import build_for_run
    from dr_scale.parallel.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    shape = resolve_shape(ModelConfig(preset="tiny"), 4096)
    result = {}
    for stage in (1, 2, 3):
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": False}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        model = build_for_run(shape, ds, Topology(2, 1, 1))
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds,
                                                       model_parameters=model.parameters())
        masters, working = master_partitions(optimizer, stage)
        result[stage] = {
            "dtypes": sorted({str(t.dtype) for t in masters + working}),
            "own_tensor": [m.data_ptr() != w.data_ptr() for m, w in zip(masters, working)],
            "master_elements": sum(m.numel() for m in masters),
            "parameters": sum(p.ds_numel if stage == 3 else p.numel()
                              for p in model.parameters())}
        engine.destroy()
        del engine, optimizer, model
    write_and_leave(out, rank, result)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
