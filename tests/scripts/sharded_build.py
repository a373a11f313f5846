"""Run by tests/test_sharded_build.py on 2 ranks (torch.multiprocessing, gloo): a model built
under ZeRO-3's zero.Init against the same model built whole from the same seed."""
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed

    from dr_scale.config.schema import ModelConfig
    from dr_scale.models import build_model, resolve_shape
    from dr_scale.models.build import count_parameters
    from dr_scale.parallel.sharded_build import build_for_run
    from dr_scale.parallel.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for preset, precision in (("tiny", "fp32"), ("gpt2_tiny", "fp32"), ("tiny", "bf16")):
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": precision == "bf16"}}
        shape = resolve_shape(ModelConfig(preset=preset), 4096)
        torch.manual_seed(1234)
        sharded = build_for_run(shape, ds, Topology(2, 1, 1))
        torch.manual_seed(1234)
        plain = build_model(shape)
        if precision == "bf16":
            plain = plain.bfloat16()  # what deepspeed.initialize makes of it
        held = sum(p.ds_tensor.numel() for p in sharded.parameters())
        rows = {}
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
            with deepspeed.zero.GatheredParameters([p]):
                full = p.data.clone()
            rows[name] = {"equal": bool(torch.equal(full, q.data)), "dtype": str(full.dtype),
                          "placeholder": p.numel(), "mean": full.float().mean().item(),
                          "std": full.float().std().item(), "ref_mean": q.float().mean().item(),
                          "ref_std": q.float().std().item()}
        from dr_scale.parallel.optimizer_groups import param_groups

        # weight decay by each parameter's own shape, not its 1-D placeholder's
        groups = [[len(g["params"]) for g in param_groups(m, 0.1)] for m in (sharded, plain)]
        result[f"{preset}/{precision}"] = {"params": rows, "held": held, "groups": groups,
                                           "total": count_parameters(sharded),
                                           "plain_total": count_parameters(plain)}
        # model.init_from into the sharded model: a folder of small shards (a few tensors
        # each), every rank reading only its own partition of each tensor
        from safetensors.torch import save_file

        from dr_scale.export.hf import load_into
        from dr_scale.export.safetensors_folder import HFWeights

        folder = Path(f"{out}.hf{rank}.{preset}.{precision}")
        folder.mkdir()
        torch.manual_seed(99)
        source = {k: torch.randn(v.shape) for k, v in plain.state_dict().items()
                  if not (shape.tie_embeddings and k == "lm_head.weight")}
        names = sorted(source)
        for i in range(0, len(names), 5):
            save_file({k: source[k] for k in names[i:i + 5]}, str(folder / f"part{i}.safetensors"))
        load_into(sharded, HFWeights(folder), str(folder))
        loaded = {}
        for name, p in sharded.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                want = source[name].to(p.dtype)
                loaded[name] = bool(torch.equal(p.data, want))
        result[f"{preset}/{precision}"]["loaded"] = loaded
    write_and_leave(out, rank, result)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
