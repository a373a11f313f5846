#!/usr/bin/env python
"""The peer in throughput comparisons: Hugging Face's LlamaForCausalLM of the same shape, under
the same DeepSpeed config, ranks and threads, trained on random tokens of the same batch shape.
Run by benchmarks/throughput.py as its own launcher job:

    deepspeed --num_gpus 2 benchmarks/hf_peer.py --preset tiny --ds_config zero3 --seq_length 256 \
        --micro_batch_size 8 --steps 20 --warmup 5 --out peer.json
"""
import argparse
import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", required=True)
    p.add_argument("--ds_config", required=True)
    p.add_argument("--seq_length", type=int, required=True)
    p.add_argument("--micro_batch_size", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--out", required=True)
    p.add_argument("--profile_out", default=None,
                   help="after the timed steps, profile 2 more on rank 0 and write each "
                        "operator's self time there (the step profiler's .ops.json form)")
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from dr_scale.runtime import comm
    from dr_scale.config import ds_config as dsc
    from dr_scale.config import load_config
    from dr_scale.runtime.hardware import bf16_support
    from dr_scale.runtime.process_group import init_distributed
    from dr_scale.parallel.optimizer_groups import param_groups
    from dr_scale.models import resolve_shape
    from dr_scale.train.metrics import peak_memory_bytes

    device, _ = init_distributed()
    cfg = load_config(overrides=[f"model.preset={a.preset}", f"data.seq_length={a.seq_length}",
                                 f"train.micro_batch_size={a.micro_batch_size}",
                                 f"train.max_steps={a.steps}", *a.overrides])
    shape = resolve_shape(cfg.model, a.vocab_size)
    if shape.arch != "llama":
        sys.exit(f"hf_peer: the peer is a Llama; preset {a.preset} is {shape.arch}")
    world = dist.get_world_size()
    ds = dsc.fill(dsc.read_json(dsc.resolve_path(a.ds_config)), cfg, world,
                  source=a.ds_config, bf16_native=bf16_support(device.type).native,
                  device_type=device.type)
    hf_cfg = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.ffn_hidden_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads,
                         max_position_embeddings=shape.max_seq_length, rms_norm_eps=shape.norm_eps,
                         rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_embeddings,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg)
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      model_parameters=param_groups(model, cfg.train.weight_decay))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    batch_sizes = dsc.batch_sizes(cfg.train, world)
    tokens_per_step = batch_sizes["global"] * a.seq_length
    t0 = None
    for step in range(a.steps):
        if step == a.warmup:
            comm.barrier()
            t0 = time.perf_counter()
        for _ in range(batch_sizes["accum"]):
            x = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g)
            x = x.to(device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    comm.barrier()
    seconds = time.perf_counter() - t0
    if a.profile_out:  # outside the timed steps: the profiler's overhead is not in tokens/s
        from dr_scale.callbacks.step_profiler import write_operator_totals

        def one_step():
            for _ in range(batch_sizes["accum"]):
                x = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length),
                                  generator=g).to(device)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()

        profile_steps = 2
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:  # every rank: same pace
            for _ in range(profile_steps):
                one_step()
        if dist.get_rank() == 0:
            write_operator_totals(prof, a.profile_out, profile_steps)
    mem = torch.tensor([peak_memory_bytes(device.type)], dtype=torch.float64)
    comm.all_reduce(mem, "max")  # placed where the group serves it (NCCL: the GPU)
    if dist.get_rank() == 0:
        measured = a.steps - a.warmup
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": measured * tokens_per_step / seconds,
                       "step_time_s": seconds / measured, "mem_peak_bytes": int(mem.item()),
                       "loss": float(loss)}, f)
    comm.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
