"""Building blocks shared by the decoders: norms, rotary tables, attention block, MLPs."""
import contextlib
import math

import torch
from torch import nn
import torch.nn.functional as F

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops, reference
from dr_scale.kernels.registry import implementation
from dr_scale.models.initial_values import fill_value, fill_values, zero3_partition_range


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class Rotary(nn.Module):
    """cos/sin tables, kept as non-persistent fp32 buffers (recomputed, never checkpointed).

    They are the same however the model is built or cast: computed on the CPU from integer
    positions (reference.rotary_tables: exact also inside DeepSpeed's zero.Init), made by
    `init_buffers` for a model built on meta, and left fp32 by dtype casts (`_apply`), so a bf16
    model rotates by the angles its fp32 export will."""

    def __init__(self, head_dim: int, max_seq: int, theta: float, scaling=None):
        """`scaling`: a models.rope_scaling.RopeScaling, or None."""
        super().__init__()
        self.table_args = (max_seq, head_dim, theta, scaling)
        if torch.empty(0).device.type == "meta":  # built on meta: init_buffers fills them later
            # (computing them there has no values to give, and torch's meta arange imports
            # torch._dynamo: ~2 s of a launch's memory estimate on a 2-core CPU)
            cos, sin = torch.empty(max_seq, head_dim), torch.empty(max_seq, head_dim)
        else:
            cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self):
        max_seq, head_dim, theta, scaling = self.table_args
        return reference.rotary_tables(max_seq, head_dim, theta, device="cpu",
                                       scale_frequencies=scaling)

    def init_buffers(self):
        """The tables computed on the CPU, for a model built on the meta device."""
        self.cos, self.sin = self._tables()

    def _apply(self, fn, recurse=True):
        """Moves and casts of the module reach its buffers here (`model.bfloat16()`, `.to()`):
        the tables follow a move to another device but keep fp32 through a cast."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        if self.cos.dtype != cos.dtype:
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def forward(self, seq_len: int, position_ids=None):
        """Tables for positions 0..seq_len-1, (seq, head_dim); or, with `position_ids` (batch,
        seq) (positions restarting at each packed document), per token, (batch, 1, seq,
        head_dim), broadcasting over the heads."""
        if position_ids is None:
            return self.cos[:seq_len], self.sin[:seq_len]
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


class SelfAttention(nn.Module):
    """Multi-head attention with grouped-query heads; rotary when `rotary` tables are passed."""

    def __init__(self, shape, bias: bool, out_bias: bool = None):
        """`bias` on the q, k, v projections; `out_bias` on the output one (default: `bias`)."""
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, hd
        self.q_proj = nn.Linear(d, shape.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, shape.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, shape.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(shape.num_heads * hd, d, bias=bias if out_bias is None else out_bias)
        # `auto` is settled at start (models/kernel_choice.py) from the same table
        self.attend = None if shape.attention == "auto" else implementation("attention",
                                                                            shape.attention)
        self.dropout = shape.dropout

    def forward(self, x, rotary=None, doc_ids=None):
        """`doc_ids` (batch, seq), for packed documents: a token attends only to its own."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Head counts and length come from the projections' outputs: under tensor parallelism
        # each rank holds a slice of the heads, under sequence parallelism x is a slice of the
        # sequence and the projections return all of it; the module need not know either.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary
            q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        if self.attend is None:
            raise DrScaleError("model.attention=auto: settle it (models/kernel_choice.py) "
                               "before building a model to run")
        # doc_ids only when given: an attention kernel registered elsewhere need not take them
        extra = {} if doc_ids is None else {"doc_ids": doc_ids}
        out = self.attend(q, k, v, causal=True, dropout_p=self.dropout, training=self.training,
                          **extra)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class GeluMLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.fc_in = nn.Linear(d, ffn)
        self.fc_out = nn.Linear(ffn, d)

    def forward(self, x):
        if type(self.fc_in) is nn.Linear:  # the bias goes into the fused kernel, not the matmul
            return self.fc_out(ops.bias_gelu(F.linear(x, self.fc_in.weight), self.fc_in.bias))
        # A parallel wrapper (tensor parallel) runs its own forward, communication included.
        h = self.fc_in(x)
        return self.fc_out(ops.bias_gelu(h, h.new_zeros(h.shape[-1])))


def causal_lm_loss(logits, shift_labels, **_):
    """Mean token cross-entropy (fp32) of logits against labels already shifted by the data.

    Models keep it as their `loss_function` attribute, in the signature Hugging Face models use,
    so that under tensor parallelism DeepSpeed can put its vocabulary-parallel loss in its place
    (logits then hold only this rank's slice of the vocabulary)."""
    return ops.cross_entropy(logits, shift_labels)


# Projections that write into the residual stream; scaled at init (GPT-2 / Megatron practice).
RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "fc_out")


def initial_rules(model: nn.Module, std: float, num_layers: int) -> dict:
    """Each parameter's initial value by name: ("normal", std) for every matrix and embedding,
    std/sqrt(2L) for residual outputs, ("zeros",) for biases, ("ones",) for norm weights. A
    tied weight is named once, by its first owner (as named_parameters names it)."""
    out_std = std / math.sqrt(2 * num_layers)
    rules, seen = {}, set()
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                name = f"{module_name}.{attr}" if module_name else attr
                rules[name] = _rule(module_name, module, attr, std, out_std)
    return rules


def _rule(module_name: str, module: nn.Module, attr: str, std: float, out_std: float):
    if hasattr(module, "initial_rule"):  # a module of ours with parameters of its own
        return module.initial_rule(attr, std, out_std)
    if attr == "bias":
        return ("zeros",)
    if isinstance(module, (RMSNorm, nn.LayerNorm)):
        return ("ones",)
    if isinstance(module, nn.Linear):
        return ("normal", out_std if module_name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS else std)
    if isinstance(module, nn.Embedding):
        return ("normal", std)
    raise TypeError(f"no initial value for {module_name}.{attr} ({type(module).__name__})")


@torch.no_grad()
def init_weights(model: nn.Module, std: float, num_layers: int):
    """Every parameter set to its initial value (initial_rules; models/initial_values.py). Under
    ZeRO-3's sharded construction each rank fills its own partition and nothing is gathered
    (parameters offloaded to NVMe aside: gathered whole, one at a time, `whole`); this runs after
    zero.Init has closed (parallel/sharded_build.py), where torch's constructors are torch's
    again."""
    for name, rule in initial_rules(model, std, num_layers).items():
        param = model.get_parameter(name)
        if hasattr(param, "ds_id") and not _on_nvme(param):
            start, count = zero3_partition_range(param)
            part = param.ds_tensor
            fill_values(rule, param.ds_shape, name, start, part.narrow(0, 0, count))
            part.narrow(0, count, part.numel() - count).zero_()  # the padding
            continue
        with whole(param):
            fill_value(rule, name, param.data)


def _on_nvme(param) -> bool:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return getattr(param.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme


def whole(param: nn.Parameter):
    """The parameter whole inside the block, and written back to every rank's shard after it,
    where ZeRO-3's zero.Init has partitioned it (rank 0's values win; every rank draws the same
    ones); as it is otherwise."""
    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


def decoder_blocks(model: nn.Module):
    """The modules that directly own an attention layer: the decoder blocks, in order."""
    return [m for m in model.modules()
            if any(isinstance(c, SelfAttention) for c in m.children())]
