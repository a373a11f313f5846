"""Run by tests/test_lm_head.py on 2 ranks (torch.multiprocessing, gloo): the fused loss over a
vocabulary-parallel head (uneven slices of 101 rows), several chunks and ignored tokens, against
the whole-logits loss on one process. Each rank writes its loss, hidden-state gradient and its
slice's weight gradient, and the reference's. With a third argument `triton_fused` the slices go
through the Triton cross-entropy kernels (on CPU under TRITON_INTERPRET=1)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, out, kernel):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import deepspeed
    from deepspeed.module_inject.layers import ColumnParallel

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)  # ColumnParallel asks it

    from dr_scale.kernels import ops
    from dr_scale.models.lm_head import linear_cross_entropy

    # on a GPU machine the slices are on the GPU (gloo reduces CUDA tensors too): the Triton
    # kernels there run compiled, not interpreted, and take device tensors only
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    vocab, d, tokens = 101, 16, 37
    hidden = torch.randn(tokens, d, generator=g)
    weight = torch.randn(vocab, d, generator=g) * 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::5] = -100  # ignored
    labels[1], labels[2] = 0, vocab - 1  # targets at both slices' edges
    rows = [51, 50]
    start = sum(rows[:rank])
    group = dist.new_group([0, 1])

    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(rh @ rw.t(), labels, ignore_index=-100)
    ref.backward()
    result = {"ref": ref.item(), "ref_grad_h": rh.grad.tolist(),
              "ref_grad_w": rw.grad[start:start + rows[rank]].tolist()}
    for dtype in (torch.float32, torch.bfloat16):
        ops.use_kernels(device, dtype, forced={"cross_entropy": kernel})
        h = hidden.clone().to(device, dtype).requires_grad_()
        w = weight[start:start + rows[rank]].clone().to(device, dtype).requires_grad_()
        loss = linear_cross_entropy(ColumnParallel.apply(group, h), w, labels.to(device), 8,
                                    group=group, vocab_start=start)
        loss.backward()
        name = str(dtype).replace("torch.", "")
        result[name] = {"loss": loss.item(), "grad_h": h.grad.float().tolist(),
                        "grad_w": w.grad.float().tolist()}
    write_and_leave(f"{out}/result", rank, result)


if __name__ == "__main__":
    kernel = sys.argv[3] if len(sys.argv) > 3 else "torch"
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2], kernel), nprocs=2)
