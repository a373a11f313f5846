"""Run by tests/test_kernel_choice.py on 2 ranks (torch.multiprocessing, gloo): rank 0 measures
the kernels and broadcasts its choice; each rank has its own cache folder."""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DR_SCALE_CACHE=f"{out}/cache{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from dr_scale.errors import DrScaleError
    from dr_scale.kernels import measured
    from dr_scale.kernels.registry import candidates

    called = [0]

    def count(kernel):
        def fn(*args, **kwargs):
            called[0] += 1
            return kernel.fn(*args, **kwargs)
        return dataclasses.replace(kernel, fn=fn)

    problem = measured.Problem(batch=1, seq=64, hidden=64, ffn=128, heads=2, kv_heads=1,
                               head_dim=32, vocab=100, loss_rows=64)
    attention = [count(k) for k in candidates("attention", "cpu", torch.float32)]
    chosen, _ = measured.choose({"attention": attention}, problem, "cpu", torch.float32)
    norm = candidates("rms_norm", "cpu", torch.float32)[0]
    wrong = dataclasses.replace(norm, fn=lambda x, w, e: norm.fn(x, w, e) * 2)
    try:
        measured.choose({"rms_norm": [wrong]}, problem, "cpu", torch.float32)
        error = None
    except DrScaleError as e:
        error = str(e)
    cache = f"{out}/cache{rank}/{measured.CACHE}"
    entries = len(json.load(open(cache))) if os.path.exists(cache) else 0
    write_and_leave(f"{out}/result", rank, {"chosen": chosen, "called": called[0],
                                            "cache_entries": entries, "error": error})


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
