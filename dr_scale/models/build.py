"""From `model:` config (+ the tokenizer's vocabulary) to a concrete shape and an nn.Module."""
from contextlib import contextmanager, nullcontext
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from dr_scale.errors import DrScaleError
from dr_scale.models.layers import init_weights
from dr_scale.models.moe import MoEShape
from dr_scale.models.rope_scaling import RopeScaling
from dr_scale.models.spec import ModelSpec
from dr_scale.kernels.registry import implementation
from dr_scale.registry import MODEL_REGISTRY


@dataclass(frozen=True)
class ModelShape:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_length: int
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float
    attention: str = "sdpa"
    dropout: float = 0.0
    init_std: float = 0.02
    loss_chunk_tokens: Optional[int] = None  # the fused LM head + loss (models/lm_head.py)
    rope_scaling: Optional[RopeScaling] = None  # a mapping is parsed (configs, run.json)
    moe: Optional[MoEShape] = None  # experts (a mapping is parsed); None: a dense MLP

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling",
                           RopeScaling.parse(self.rope_scaling, "model.rope_scaling"))
        object.__setattr__(self, "moe", MoEShape.parse(self.moe, "model.moe"))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the fused LM head + cross-entropy; 0: logits kept whole."""
        return self.loss_chunk_for(self.vocab_size)

    def settle_loss_chunk(self, tokens: int, slices: int = 1) -> "ModelShape":
        """The shape with model.loss_chunk_tokens decided for a run of `tokens` per micro-batch
        over a head of `slices` vocabulary slices, where it was left unset (auto): the chunk the
        budget allows when the micro-batch is larger, else 0 (logits whole). A micro-batch of at
        most one chunk keeps its logits within the chunk budget anyway, and the fused path would
        only add the head's fp32 weight-gradient buffer (llama_70b, TP 8, 4,096 tokens: 1.25 GB
        fused against 1.05 GB whole, by the estimator)."""
        if self.loss_chunk_tokens is not None:
            return self
        chunk = self.loss_chunk_for(-(-self.vocab_size // slices))
        return dataclasses.replace(self, loss_chunk_tokens=chunk if tokens > chunk else 0)

    def loss_chunk_for(self, rows: int) -> int:
        """The same for a head of `rows` vocabulary rows (a vocabulary-parallel slice: narrower,
        so larger chunks and fewer all-reduces): model.loss_chunk_tokens where set, else as many
        tokens as keep the chunk's fp32 logits within the budget (models/lm_head.py)."""
        if self.loss_chunk_tokens is None:
            from dr_scale.models.lm_head import chunk_tokens

            return chunk_tokens(rows)
        return self.loss_chunk_tokens

    def weights_signature(self) -> dict:
        """The fields that decide the shape of the weights (a checkpoint must match them)."""
        keys = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "ffn_hidden_size", "vocab_size", "tie_embeddings")
        signature = {k: getattr(self, k) for k in keys}
        if self.moe is not None:
            signature["num_experts"] = self.moe.num_experts
            # the experts' layout where it is not the plain one (older checkpoints lack them)
            moe, f = self.moe, self.ffn_hidden_size
            for key, value, plain in (("expert_ffn", moe.expert_width(f), f),
                                      ("shared_ffn", moe.shared_width(f), 0),
                                      ("shared_gate", moe.shared_gate, False),
                                      ("dense_layers", moe.dense_layers, 0),
                                      ("expert_bias", moe.expert_bias, False)):
                if value != plain:
                    signature[f"moe_{key}"] = value
        return signature


def spec_of(arch: str, source: str = "model") -> ModelSpec:
    try:
        return MODEL_REGISTRY.get(arch)
    except DrScaleError as e:
        raise DrScaleError(f"{source}.arch: {e}") from None


def all_presets():
    """Preset name -> shape fields, over every registered family."""
    out = {}
    for arch in MODEL_REGISTRY.names():
        for name, fields in MODEL_REGISTRY.get(arch).presets.items():
            if name in out:
                raise DrScaleError(f"model preset '{name}' is defined by two families")
            out[name] = fields
    return out


def pad_vocab(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_shape(model_cfg, tokenizer_vocab: Optional[int] = None, source="model") -> ModelShape:
    """Preset values, overridden by any field set in the config; vocabulary from the tokenizer."""
    presets = all_presets()
    if model_cfg.preset not in presets:
        raise DrScaleError(f"{source}.preset: unknown preset '{model_cfg.preset}'; known: "
                           f"{', '.join(sorted(presets))}")
    values = dict(presets[model_cfg.preset])
    for f in dataclasses.fields(ModelShape):
        v = getattr(model_cfg, f.name, None)
        if f.name == "moe":
            values["moe"] = moe_fields(values.get("moe"), v, source)
        elif v is not None and f.name != "vocab_size":
            values[f.name] = v
    if tokenizer_vocab is not None:
        values["vocab_size"] = vocab_for(model_cfg, tokenizer_vocab, source)
    elif model_cfg.vocab_size is not None:
        values["vocab_size"] = model_cfg.vocab_size
    shape = ModelShape(**values)
    spec = spec_of(shape.arch, source)
    if shape.hidden_size % shape.num_heads:
        raise DrScaleError(f"{source}.hidden_size={shape.hidden_size} is not divisible by "
                           f"{source}.num_heads={shape.num_heads}")
    if shape.num_heads % shape.num_kv_heads:
        raise DrScaleError(f"{source}.num_heads={shape.num_heads} is not a multiple of "
                           f"{source}.num_kv_heads={shape.num_kv_heads}")
    if spec.experts != (shape.moe is not None):
        raise DrScaleError(f"{source}.moe: the {shape.arch} family has " + (
            f"a mixture of experts: set {source}.moe.num_experts" if spec.experts else
            f"a dense MLP; expert settings need a mixture-of-experts preset (moe_tiny, ...)"))
    if spec.rotary and shape.head_dim % 2:
        raise DrScaleError(f"{source}: head dim {shape.head_dim} must be even for rotary embeddings")
    if shape.attention != "auto":  # auto is settled at start, once the device is known
        try:
            implementation("attention", shape.attention)
        except DrScaleError as e:
            raise DrScaleError(f"{source}.attention: {e}") from None
    return shape


def moe_fields(preset: Optional[dict], section, source: str) -> Optional[dict]:
    """The experts: the preset's, with any model.moe field set in the config over them."""
    given = {} if section is None else {k: v for k, v in section.to_dict().items()
                                        if v is not None}
    if not preset and not given:
        return None
    if not preset and "num_experts" not in given:
        raise DrScaleError(f"{source}.moe: a dense preset given expert settings needs "
                           f"{source}.moe.num_experts (or a mixture-of-experts preset)")
    return {**(preset or {}), **given}


def vocab_for(model_cfg, tokenizer_vocab: int, source="model") -> int:
    """The embedding's rows for a tokenizer: model.vocab_size where set (at least the
    tokenizer's), else the tokenizer's padded to model.pad_vocab_multiple."""
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < tokenizer_vocab:
        raise DrScaleError(
            f"{source}.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab}); token ids would fall outside the embedding")
    return model_cfg.vocab_size or pad_vocab(tokenizer_vocab, model_cfg.pad_vocab_multiple)


def with_tokenizer_vocab(shape: ModelShape, cfg, tokenizer_vocab: int, topo) -> ModelShape:
    """A run's shape once its tokenizer is known (the data step): the vocabulary settled, and
    the fused head's chunk for this rank's micro-batch and vocabulary slice."""
    shape = dataclasses.replace(shape, vocab_size=vocab_for(cfg.model, tokenizer_vocab))
    return shape.settle_loss_chunk(cfg.train.micro_batch_size * cfg.data.seq_length,
                                   topo.head_slices(cfg.parallel.vocab_parallel))


def build_model(shape: ModelShape, device: Optional[str] = None,
                draw: bool = True) -> torch.nn.Module:
    """The plain nn.Module with its initial values (models/layers.py init_weights); on
    device="meta", its structure only (counting, estimates, sharded builds). `draw=False`: zeros,
    for values a checkpoint or init_from folder supplies next."""
    model = construct(shape, device)
    if device != "meta":
        if draw:
            initialize(model, shape)
        else:
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
    return model


def construct(shape: ModelShape, device: Optional[str] = None) -> torch.nn.Module:
    """The module's structure: parameters allocated, torch's own initialisers skipped (every
    parameter gets its value from `initialize` or a checkpoint), computed buffers made. Its
    values are set apart from it so that a build inside DeepSpeed's zero.Init, which rewrites
    torch's tensor constructors while it is open, sets them after it has closed
    (parallel/sharded_build.py)."""
    module = spec_of(shape.arch).module
    with (torch.device(device) if device else nullcontext()), _no_initialisation():
        return module(shape)


def initialize(model: torch.nn.Module, shape: ModelShape):
    """Every parameter of a constructed model set to its initial value."""
    init_weights(model, shape.init_std, shape.num_layers)


# torch's layers initialise their weights as they are built, values that init_weights replaces
# anyway; on meta there are no values at all, and torch's meta `normal_` is a Python reference
# that imports torch._dynamo on first use: 1.6-2.2 s of every launch on a 2-core CPU. So while a
# model is constructed the initialisers return their tensor untouched (as transformers'
# no_init_weights and accelerate's init_empty_weights do).
_INITIALISERS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def _no_initialisation():
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def count_parameters(model: torch.nn.Module) -> int:
    """Whole-model count, also of a model built sharded (ZeRO-3 keeps the full size in
    ds_numel; the tensor itself is an empty placeholder)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += getattr(p, "ds_numel", p.numel())
    return total
