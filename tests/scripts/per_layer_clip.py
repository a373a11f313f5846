"""Run by tests/test_clipping.py as `deepspeed --num_gpus 2 per_layer_clip.py OUT MAX_NORM`:
one step's gradients on the tiny model, clipped per layer under ZeRO-0, 1, 2 and 3 (fp32 and
bf16), each stage its own DeepSpeed engine from the same initial weights and batches. Rank 0
saves the whole clipped gradients (gathered with DeepSpeed's own safe_get_full_grad), the
norms and the clip factors per engine."""
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from dr_scale.callbacks.per_layer_clip import DEFAULT_EXEMPT, clip_per_layer_
from dr_scale.config import load_config
from dr_scale.runtime.process_group import init_distributed
from dr_scale.launch import leave
from dr_scale.parallel.optimizer_groups import param_groups
from dr_scale.models import build_model, resolve_shape
from dr_scale.parallel.topology import Topology

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it


def full_fp32(p):
    value = safe_get_full_fp32_param(p)  # None where the parameter is its own master (ZeRO-0)
    return (p if value is None else value).detach().float().cpu().clone()


out_path, max_norm = args[0], float(args[1])
device, _ = init_distributed()
rank = dist.get_rank()
shape = resolve_shape(load_config(overrides=["model.preset=tiny"]).model, 256)
torch.manual_seed(0)
initial = build_model(shape).state_dict()
tokens = torch.randint(0, 256, (2, 4, 33), generator=torch.Generator().manual_seed(1))
results = {"tokens": tokens, "initial": initial}
for precision in ("fp32", "bf16"):
    for stage in (0, 1, 2, 3):
        model = build_model(shape)
        model.load_state_dict(initial)
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "train_batch_size": 8, "gradient_clipping": 0.0,
              # eps=1 keeps Adam's first update proportional to the gradient (with a small eps
              # it is lr * sign(g), blind to clipping): the step shows what the optimizer consumed.
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1.0, "torch_adam": True}},
              "bf16": {"enabled": precision == "bf16"},
              "zero_optimization": {"stage": stage, "overlap_comm": False,
                                    "reduce_bucket_size": 50_000_000},
              "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, config=ds,
                                          model_parameters=param_groups(model, 0.1))
        batch = tokens[rank]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        norms, factors = clip_per_layer_(engine, max_norm, DEFAULT_EXEMPT,
                                         Topology(dist.get_world_size()))
        grads = {n: safe_get_full_grad(p).detach().float().cpu().clone()
                 for n, p in engine.module.named_parameters()}
        results[f"{precision}_zero{stage}"] = {"grads": grads, "norms": norms.cpu(),
                                               "factors": factors.cpu(),
                                               "optimizer": type(engine.optimizer).__name__}
        engine.step()
        results[f"{precision}_zero{stage}"]["stepped"] = {
            n: full_fp32(p) for n, p in engine.module.named_parameters()}
        engine.destroy()
if rank == 0:
    torch.save(results, out_path)
dist.barrier()
dist.destroy_process_group()
leave(0)  # see dr_scale.launch.leave
