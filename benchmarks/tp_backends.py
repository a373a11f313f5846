#!/usr/bin/env python
"""Tensor-parallel layer backends side by side, on this machine's ranks: megatron-core's
ColumnParallelLinear/RowParallelLinear against DeepSpeed AutoTP's LinearLayer/LinearAllreduce,
in a Llama MLP block (gate/up column-parallel, down row-parallel), forward + backward, both
checked against the dense block on one rank.

    deepspeed --num_gpus 2 benchmarks/tp_backends.py [--hidden 1024 --ffn 2816 --tokens 2048]

Prints the median milliseconds per iteration of each and the max error against dense.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dr_scale.runtime import comm


class DenseMLP(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def autotp_mlp(dense, group):
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    m = DenseMLP(1, 1)
    m.gate_proj = LinearLayer(dense.gate_proj, group)
    m.up_proj = LinearLayer(dense.up_proj, group)
    m.down_proj = LinearAllreduce(dense.down_proj, group)
    return m


class MegatronMLP(nn.Module):
    def __init__(self, dense, h, f, tp, rank):
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                  perform_initialization=False)
        init = lambda w: None  # noqa: E731  (weights copied from the dense block below)
        self.gate = ColumnParallelLinear(h, f, config=cfg, init_method=init, bias=False)
        self.up = ColumnParallelLinear(h, f, config=cfg, init_method=init, bias=False)
        self.down = RowParallelLinear(f, h, config=cfg, init_method=init, bias=False,
                                      input_is_parallel=True, skip_bias_add=False)
        part = f // tp
        with torch.no_grad():
            self.gate.weight.copy_(dense.gate_proj.weight[rank * part:(rank + 1) * part])
            self.up.weight.copy_(dense.up_proj.weight[rank * part:(rank + 1) * part])
            self.down.weight.copy_(dense.down_proj.weight[:, rank * part:(rank + 1) * part])

    def forward(self, x):
        g, _ = self.gate(x)
        u, _ = self.up(x)
        out, _ = self.down(F.silu(g) * u)
        return out


def timed(model, x, dy, iters):
    times = []
    for i in range(iters + 3):
        xi = x.detach().requires_grad_()
        comm.barrier()
        t0 = time.perf_counter()
        model(xi).backward(dy)
        comm.barrier()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, xi.grad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from dr_scale.runtime.process_group import init_distributed

    init_distributed()
    from megatron.core import parallel_state

    tp, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    dense = DenseMLP(a.hidden, a.ffn)
    x = torch.randn(a.tokens, a.hidden)
    dy = torch.randn(a.tokens, a.hidden)
    dense_ms, dense_dx = timed(dense, x, dy, a.iters)
    ref = dense(x).detach()
    results = {"dense (1 rank's work)": (dense_ms, 0.0)}
    for name, model in (("megatron-core", MegatronMLP(dense, a.hidden, a.ffn, tp, rank)),
                        ("deepspeed-autotp", autotp_mlp(DenseMLP(a.hidden, a.ffn), group))):
        if name == "deepspeed-autotp":  # same weights as dense, partitioned by AutoTP itself
            model = autotp_mlp(_copy(dense, a.hidden, a.ffn), group)
        ms, dx = timed(model, x, dy, a.iters)
        err = max((model(x) - ref).abs().max().item(), (dx - dense_dx).abs().max().item())
        results[name] = (ms, err)
    if rank == 0:
        print(f"MLP block h={a.hidden} f={a.ffn} tokens={a.tokens}, TP={tp}, "
              f"{torch.get_num_threads()} thread(s)/rank")
        for name, (ms, err) in results.items():
            print(f"  {name:<22} {ms:8.2f} ms fwd+bwd   max error vs dense {err:.1e}")
    comm.barrier()


def _copy(dense, h, f):
    m = DenseMLP(h, f)
    m.load_state_dict(dense.state_dict())
    return m


if __name__ == "__main__":
    main()
