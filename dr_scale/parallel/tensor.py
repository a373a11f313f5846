"""Tensor parallelism through DeepSpeed AutoTP, with a partition plan per registered model.

The plan names the model's linears by pattern: Megatron-style column-parallel for the projections
that fan out (q, k, v, gate, up, fc_in) and row-parallel for those that write back into the
residual stream (o, down, fc_out), one all-reduce per attention and per MLP block. Embeddings,
norms and the LM head stay replicated. The model itself is untouched: attention infers its local
head count from the projection's output width.

Why AutoTP rather than megatron-core's tensor_parallel layers: both give the dense block's
outputs and gradients (max error 2.2e-07 in fp32), and benchmarks/tp_backends.py, a Llama MLP
block (h 1024, f 2816, 2048 tokens) forward + backward on 2 CPU ranks, measured AutoTP at 422-476
ms against megatron-core's 633-648 ms (dense on one rank: 1216-1234 ms; 2026-11-30, 2-core CI
machine). AutoTP also needs no model rewrite (a plan of name patterns), works with ZeRO-1/2/3 and
DeepSpeed's checkpoints, and megatron-core's layers want its CUDA RNG tracker for initialization.
"""
from dr_scale.errors import DrScaleError

PLANS = {
    "llama": [
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(gate|up)_proj\.weight$"],
         "partition_type": "column"},
        {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"],
         "partition_type": "row"},
    ],
    "gpt2": [
        {"patterns": [r".*\.attn\.[qkv]_proj\.weight$", r".*\.mlp\.fc_in\.weight$"],
         "partition_type": "column"},
        {"patterns": [r".*\.attn\.o_proj\.weight$", r".*\.mlp\.fc_out\.weight$"],
         "partition_type": "row"},
    ],
}


def check_divisible(shape, tp: int):
    for key, value in (("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads),
                       ("ffn_hidden_size", shape.ffn_hidden_size)):
        if value % tp:
            raise DrScaleError(f"parallel.tensor_parallel={tp} does not divide model.{key}={value}")


def autotp_section(shape, tp: int) -> dict:
    """The DeepSpeed `tensor_parallel` config section for this model and TP size."""
    if shape.arch not in PLANS:
        raise DrScaleError(f"parallel.tensor_parallel: no tensor-parallel plan for model arch "
                           f"'{shape.arch}'; plans exist for {', '.join(sorted(PLANS))}")
    check_divisible(shape, tp)
    return {"autotp_size": tp,
            "partition_config": {"use_default_specs": False, "layer_specs": PLANS[shape.arch]}}
