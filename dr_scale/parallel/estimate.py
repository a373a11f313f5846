"""Per-rank memory estimate for a run, without building the model (meta device).

What is counted, per rank, for AdamW under DeepSpeed:
- parameters: the working copy the forward reads (bf16/fp16, or fp32), sharded by tensor
  parallel and, under ZeRO-3, by data parallel; a mixture of experts' experts by expert
  parallelism (1/EP of them on a rank; ZeRO-1/2 partitions them over the DP/EP ranks holding the
  same ones, so a rank's partitions of the optimizer state and gradients stay 1/DP of all);
- gradients: the working-precision gradients (ZeRO-2/3: this rank's partition) plus the fp32
  gradient DeepSpeed makes for the step: under mixed precision (ZeRO-0: whole; ZeRO-1/2:
  partition; ZeRO-3: one `sub_group_size` sub-group of the partition at a time,
  `step_sub_group`), and in fp32 too under ZeRO-1/2/3, whose step flattens the partition's
  gradients into a new tensor (runtime/zero/stage_1_and_2.py, stage3.py
  `_prepare_fp32_grad_for_sub_group`);
- optimizer states: fp32 master weights (mixed precision, and in fp32 under ZeRO-1/2/3: ZeRO-1/2
  clone the partition for the optimizer, and ZeRO-3 means to share it when the dtypes agree but
  compares the tensor's device with a device *name* (stage3.py `_create_fp32_partitions`), which
  torch never finds equal, so it clones too: `master_weight_bytes`) and Adam's two moments,
  partitioned by ZeRO-1+; with optimizer offload to the CPU they live in host memory (reported
  apart on a GPU, counted on a CPU, where host memory is the rank's), with the fp32 gradients;
  offloaded to NVMe (ZeRO-Infinity) they live in files, and DeepSpeed swaps them through
  `buffer_count` host buffers of one sub-group (`sub_group_size` parameters, fp32) each, while
  the fp32 copy of the step's gradient partition is made whole before it is swapped out
  (measured: llama_1b cut to 8 layers, 2 ranks, 3.84 GiB a rank against 3.07 estimated without
  it);
- parameters offloaded (ZeRO-3 `offload_param`): to the CPU, a GPU rank's 16-bit partition lives
  in host memory (reported with `host_offload`); to NVMe, DeepSpeed keeps the 16-bit partition in
  a host buffer up to `max_in_cpu` parameters (default 1e9: all of it below that) and swaps the
  rest through `buffer_count` x `buffer_size` page-locked buffers (default 5 x 1e8: 0.93 GiB in
  bf16, resident from zero.Init on; partitioned_param_swapper.py), plus one page-locked buffer of
  the largest sub-group's whole parameters for the step's swap-out when some are on NVMe
  (measured, llama_1b cut to 8 layers, 2 ranks, bf16, defaults: 4.45 GiB a rank against 3.64
  with only the optimizer state on NVMe);
- activations: the tensors the backward pass keeps, counted from this code's layers (norm
  statistics in fp32, q/k/v/attention output, MLP gates) for one micro-batch, divided by the
  checkpointing policy, plus the loss's: one chunk of logits and the head's gradients when the
  head and loss are fused (the default), else the whole logits and their fp32 loss copies;
- buffers: DeepSpeed's communication buckets: the contiguous gradient bucket ZeRO-2/3 allocate
  at `reduce_bucket_size` elements, ZeRO-3's gathered parameters (up to
  `stage3_max_live_parameters`, default 1e9: the whole 16-bit model below that size; gathered
  by block, at least one decoder block's),
  ZeRO-0/1's flattened all-reduce bucket;
- runtime: what a rank costs before the model (the framework, communication buffers); on CPU
  measured here as the resident size of an initialized rank (RUNTIME_BYTES), on a GPU the caching
  allocator's reserve is not counted. On CPU the figures take freed memory as given back:
  glibc keeps freed heap pages (tensors below its mmap threshold: ZeRO-3's gathered TP slices)
  under the optimizer step unless `train.release_host_memory` trims them (measured, llama_1b
  cut to 8 layers, DP 2 x TP 2: 1.24x this estimate without, 1.02x with; runtime/host_memory.py).

`total` is the steady state of training. Building the model comes first (parallel/
sharded_build.py): under ZeRO-3 without pipeline parallelism it is built sharded (with tensor
parallelism, each module's slices partitioned as they are made), and a rank holds at most one
tensor whole, in fp32 and in the training precision, while it is cast and partitioned; otherwise
under tensor or pipeline parallelism a rank makes real only its slices of its stage
(in the training precision), one tensor whole in fp32 at a time while it is cut; elsewhere every
rank builds the whole model in fp32 first. `startup_peak` is that
moment (runtime included), `peak` the larger of the two: what the rank needs.
"""
import dataclasses
import functools
import math
from dataclasses import asdict, dataclass

from dr_scale.models.build import spec_of
from dr_scale.parallel.topology import Topology

# Resident set of a CPU rank after torch + DeepSpeed + gloo are up, before the model: measured on
# the 2-core CI machine (python, torch 2.13, deepspeed 0.19.8) as the peak RSS of a run of a
# 1-layer, 64-wide model (benchmarks/estimate_check.py reports it afresh).
RUNTIME_BYTES_CPU = 560 * 2**20
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int
    runtime: int
    host_offload: int  # a GPU rank's optimizer state and fp32 gradients (ZeRO offload to the
    #                    CPU) and offloaded 16-bit parameters in host memory, not in `total`
    total: int         # steady state of training
    startup_peak: int  # while the model is built, before DeepSpeed partitions it
    peak: int          # max(total, startup_peak)
    largest_transient: int  # the largest single allocation a rank makes, start-up or step (part
    #                         of the figures above; what it is: `transient_is`)
    transient_is: str = ""

    def as_dict(self):
        """The byte counts by name (`transient_is` apart)."""
        return {k: v for k, v in asdict(self).items() if k != "transient_is"}


@functools.lru_cache(maxsize=8)
def meta_model(shape):
    """The model on the meta device (nothing allocated), once per shape: the what-if estimates
    of the launcher's memory check ask for the same shape many times."""
    from dr_scale.models import build_model

    return build_model(shape, device="meta")


def largest_tensor(shape) -> int:
    """Elements of the model's largest parameter (the embedding or a projection)."""
    return max(p.numel() for p in meta_model(shape).parameters())


def split_parameters(shape, tp: int, vocab_parallel: bool = False):
    """(tensor-parallel-sharded, replicated) parameter counts, from the meta-device model; with
    vocab_parallel the LM head (and the embedding tied to it) count as sharded."""
    import re

    model = meta_model(shape)
    patterns = [re.compile(p) for plan in spec_of(shape.arch).tp_plan for p in plan["patterns"]]
    sharded = replicated = 0
    seen = set()
    head = id(model.lm_head.weight) if vocab_parallel else None
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) == head or (tp > 1 and any(pat.match(name) for pat in patterns)):
            sharded += p.numel()
        else:
            replicated += p.numel()
    return sharded, replicated


def loss_bytes(shape, tokens: int, lp: int, fused: bool, slices: int = 1) -> float:
    """The LM head's output and the loss's transients, for a head of `slices` vocabulary slices
    (vocabulary-parallel) or whole. Fused (models/lm_head.py): one chunk's fp32 logits of the
    slice and their 16/32-bit gradient, the slice's weight gradient summed in fp32 (and its cast
    to 16 bits at the end under mixed precision) and the hidden states' gradient. Whole: the
    logits, their fp32 log-softmax and fp32 gradient."""
    v, d = -(-shape.vocab_size // slices), shape.hidden_size
    chunk = shape.loss_chunk_for(v)
    if fused and chunk > 0:
        chunk = min(chunk, tokens)
        weight_grad = v * d * (4 + (lp if lp < 4 else 0))
        return chunk * v * (4 + lp) + weight_grad + tokens * d * lp
    return tokens * v * (lp + 4 + 4)


@dataclass(frozen=True)
class EstimateInputs:
    """What a rank's memory depends on besides the model's shape: the layout of ranks, the
    precision, DeepSpeed's ZeRO settings (its defaults where the config is silent), the batch and
    the checkpointing. `inputs_for_run` reads them from a run's config; a what-if is
    `dataclasses.replace(inputs, zero_stage=3, ...)`."""
    topology: Topology
    precision: str
    zero_stage: int
    micro_batch: int
    seq_length: int
    vocab_parallel: bool = False
    offload_optimizer: str = "none"  # none | cpu | nvme (zero_optimization.offload_optimizer)
    offload_param: str = "none"      # none | cpu | nvme (ZeRO-3's offload_param)
    checkpointing: str = "none"
    checkpoint_every: int = 1
    device_type: str = "cpu"
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    contiguous_gradients: bool = True
    max_live_parameters: float = 1e9
    gather_block: bool = False  # ZeRO-3 gathers a decoder block at once (parallel.zero3_gather)
    sub_group_size: float = 1e9
    swap_buffers: int = 4
    param_max_in_cpu: float = 1e9
    param_buffers: int = 5
    param_buffer_size: float = 1e8


def expert_parameters(shape) -> int:
    """Parameters of the experts of every mixture-of-experts block (0 for a dense model)."""
    return sum(p.numel() for name, p in meta_model(shape).named_parameters()
               if ".mlp.experts." in name)


def block_parameters(shape) -> int:
    """Parameters of one decoder block (the largest, where they differ)."""
    from dr_scale.models.layers import decoder_blocks

    return max(sum(p.numel() for p in b.parameters()) for b in decoder_blocks(meta_model(shape)))


def estimate(shape, inputs: EstimateInputs) -> MemoryEstimate:
    """Per-rank bytes for `shape` trained as `inputs` says (see the module's text)."""
    i, topo = inputs, inputs.topology
    tp, pp, dp = topo.tensor, topo.pipeline, topo.data
    precision, zero_stage, offload_optimizer = i.precision, i.zero_stage, i.offload_optimizer
    offload_param, device_type, sub_group_size = i.offload_param, i.device_type, i.sub_group_size
    lp = 4 if precision == "fp32" else 2
    mixed = precision != "fp32"
    slices = topo.head_slices(i.vocab_parallel)  # of the LM head's vocabulary
    fused = topo.loss_in_model  # the chunked fused loss (a pipeline's last stage: whole logits)
    shape = shape.settle_loss_chunk(i.micro_batch * i.seq_length, slices)
    sharded, replicated = split_parameters(shape, tp, slices > 1)
    n = sharded / tp + replicated  # parameters this tensor-parallel rank holds
    n /= pp  # a stage holds its share of the layers (balanced by parameters)
    # expert parallelism: a rank holds 1/EP of the experts whole; ZeRO partitions them over the
    # DP/EP ranks holding the same ones, so a rank's partitions stay n / DP
    held = n - expert_parameters(shape) * (1 - 1 / topo.expert)

    zero_div = dp if zero_stage >= 1 else 1
    parameters = (n / dp if zero_stage == 3 else held) * lp
    grads_lp = (n / dp if zero_stage >= 2 else held) * lp
    # DeepSpeed's fp32 gradient (partition) and master weights: see the module's docstring
    grads_fp32 = (n * 4 / zero_div) if mixed or zero_stage >= 1 else 0
    step_flat = 0  # the step's fp32 gradient as one tensor (what `largest_transient` weighs)
    if zero_stage in (1, 2) and offload_optimizer == "none":
        step_flat = n * 4 / dp
    if zero_stage == 3 and offload_optimizer == "none":
        group = step_sub_group(n / dp, largest_tensor(shape) / dp, sub_group_size)
        # the 16-bit gradients flattened, then cast (in fp32 the cast is the flat tensor itself)
        grads_fp32 = group * (4 + (lp if mixed else 0))
        step_flat = group * 4
    master = master_weight_bytes(mixed, zero_stage)
    gradients = grads_lp + grads_fp32
    optimizer = n * (master + ADAM_STATE_BYTES) / zero_div
    host = swap = 0
    if offload_optimizer == "nvme":  # state in files, swapped a sub-group a buffer; the step's
        optimizer = 0  # fp32 gradients are whole in memory before they are swapped out
        swap = i.swap_buffers * min(sub_group_size, n / zero_div) * 4
    elif offload_optimizer == "cpu" and device_type != "cpu":  # on a CPU nothing leaves the rank
        host, optimizer, gradients = optimizer + grads_fp32, 0, grads_lp
    param_swap = 0  # host memory of the parameter swapper (a CPU rank's own)
    if zero_stage == 3 and offload_param == "nvme":
        partition = n / dp  # in a host buffer up to max_in_cpu, the rest in files
        parameters = min(partition, i.param_max_in_cpu) * lp
        param_swap = i.param_buffers * i.param_buffer_size * lp  # page-locked from zero.Init on
        if partition > i.param_max_in_cpu:  # the step swaps a sub-group's parameters out
            param_swap += min(sub_group_size, partition) * dp * lp
    if zero_stage == 3 and offload_param != "none" and device_type != "cpu":
        host, parameters, param_swap = host + parameters + param_swap, 0, 0

    tokens = i.micro_batch * i.seq_length
    per_layer = spec_of(shape.arch).activation_bytes_per_token_layer(shape, lp) * tokens
    layers = shape.num_layers / pp
    if i.checkpointing == "full":
        # checkpointed blocks keep only their input; one block is live again during its backward
        kept = math.floor(layers / i.checkpoint_every)
        acts = kept * lp * shape.hidden_size * tokens + (layers - kept) * per_layer + per_layer
    elif i.checkpointing == "selective":
        attn = lp * (shape.hidden_size + 2 * shape.num_kv_heads * shape.head_dim) * tokens
        acts = layers * (per_layer - attn / max(1, i.checkpoint_every))
    else:
        acts = layers * per_layer
    logits = loss_bytes(shape, tokens, lp, fused=fused, slices=slices)
    activations = acts / tp + logits
    if zero_stage >= 2 and i.contiguous_gradients:
        buffers = i.reduce_bucket * lp
    else:
        buffers = min(i.reduce_bucket, n) * lp
    if zero_stage == 3:
        # gathered parameters stay live until stage3_max_live_parameters of them are (measured
        # here: llama_1b cut to 8 layers peaked 0.87 GiB a rank above the other terms, at 2 and
        # at 4 ranks alike: its whole 16-bit model), beyond what the prefetch bucket brings;
        # gathered by block (parallel.zero3_gather), a whole block at least
        live = max(min(i.max_live_parameters, n), min(i.prefetch_bucket, n))
        if i.gather_block:
            live = max(live, block_parameters(shape) / tp)
        buffers += live * lp
    buffers += swap + param_swap
    runtime = RUNTIME_BYTES_CPU if device_type == "cpu" else 0
    total = parameters + gradients + optimizer + activations + buffers + runtime
    if zero_stage == 3 and not topo.pipelined:  # built sharded (TP: each module's slices partitioned as
        #                                they are made): one tensor whole at a time
        startup = runtime + largest_tensor(shape) * (4 + lp) + parameters + param_swap
    elif topo.builds_on_meta:  # built on meta: this rank's slices of its stage, made real in the
        #                     training precision, one tensor whole in fp32 while it is cut
        startup = runtime + held * lp + largest_tensor(shape) * 4
    else:  # the whole model in fp32 on every rank, then its cast copy tensor by tensor
        startup = runtime + (sharded + replicated) * 4 + largest_tensor(shape) * lp
    transient, what = largest_transient(shape, tokens, lp, fused=fused, slices=slices,
                                        step_gradient=step_flat, zero_stage=zero_stage)
    return MemoryEstimate(*(int(x) for x in (parameters, gradients, optimizer, activations,
                                            buffers, runtime, host, total, startup,
                                            max(total, startup), transient)),
                          transient_is=what)


def step_sub_group(partition: float, largest_piece: float, sub_group_size: float) -> float:
    """Parameters of the largest sub-group ZeRO-3's step updates at once: it makes their fp32
    gradient, the group's 16-bit gradients flattened into a new tensor and cast, and frees it
    after the group's update (stage3.py `_prepare_fp32_grad_for_sub_group`,
    `_release_sub_group`). A sub-group takes whole parameter partitions until it reaches
    `sub_group_size`, so it can pass it by one partition (`largest_piece`), and never holds more
    than the rank's `partition`."""
    return min(partition, sub_group_size + largest_piece)


def master_weight_bytes(mixed: bool, zero_stage: int) -> int:
    """Bytes a parameter of DeepSpeed's fp32 master copy: under mixed precision always; in fp32
    ZeRO-1/2/3 clone the partition all the same (ZeRO-3's share is never taken: see the module's
    docstring; tests/test_estimate.py checks this against real engines), and ZeRO-0 steps torch's
    optimizer on the model itself."""
    return 4 if mixed or zero_stage >= 1 else 0


def largest_transient(shape, tokens: int, lp: int, fused: bool, slices: int = 1,
                      step_gradient: float = 0, zero_stage: int = 0):
    """(bytes, what) of the largest single tensor a rank allocates: a parameter made whole in
    fp32 at start-up (models/layers.py initial_value, every build), the loss's: one chunk of
    fp32 logits and the head's fp32 weight gradient (fused), the fp32 logits (whole), of this
    rank's vocabulary slice under a vocabulary-parallel head; or the optimizer step's flat fp32
    gradient (`step_gradient` bytes: ZeRO-1/2's partition, ZeRO-3's sub-group)."""
    v, d = -(-shape.vocab_size // slices), shape.hidden_size
    candidates = [(largest_tensor(shape) * 4, "the largest parameter made whole in fp32 at "
                                              "start-up")]
    if step_gradient:
        candidates.append((step_gradient, "the step's flat fp32 gradient of "
                           + ("one sub-group" if zero_stage == 3 else "the partition")))
    chunk = shape.loss_chunk_for(v)
    if fused and chunk > 0:
        chunk = min(chunk, tokens)
        candidates += [(chunk * v * 4, f"one chunk of fp32 logits ({chunk} tokens)"),
                       (v * d * 4, "the LM head's fp32 weight gradient")]
    else:
        candidates.append((tokens * v * 4, "the fp32 logits of a micro-batch"))
    return max(candidates)


def inputs_for_run(cfg, ds: dict, topology: Topology, device_type: str = "cpu") -> EstimateInputs:
    """A run's EstimateInputs from its RunConfig, filled DeepSpeed config and Topology."""
    from dr_scale.config import ds_config as dsc

    zero = ds.get("zero_optimization", {})
    offload_param = zero.get("offload_param") or {}
    # DeepSpeed's defaults where the config is silent (ZeRO-3 spells its bucket sizes
    # stage3_*; contiguous_gradients defaults on)
    return EstimateInputs(
        topology=topology, precision=dsc.precision(ds), zero_stage=dsc.zero_stage(ds),
        micro_batch=cfg.train.micro_batch_size, seq_length=cfg.data.seq_length,
        vocab_parallel=cfg.parallel.vocab_parallel,
        offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none"),
        offload_param=offload_param.get("device", "none"),
        checkpointing=cfg.parallel.activation_checkpointing,
        checkpoint_every=cfg.parallel.checkpoint_every, device_type=device_type,
        reduce_bucket=float(zero.get("reduce_bucket_size", 5e8)),
        prefetch_bucket=float(zero.get("stage3_prefetch_bucket_size", 5e7)),
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        max_live_parameters=float(zero.get("stage3_max_live_parameters", 1e9)),
        gather_block=cfg.parallel.zero3_gather == "block",
        sub_group_size=dsc.sub_group_size(ds),
        swap_buffers=int((zero.get("offload_optimizer") or {}).get("buffer_count", 4)),
        param_max_in_cpu=float(offload_param.get("max_in_cpu", 1e9)),
        param_buffers=int(offload_param.get("buffer_count", 5)),
        param_buffer_size=float(offload_param.get("buffer_size", 1e8)))


def shape_for_run(cfg, vocab: int = None, shape=None):
    """The shape a run's estimate counts: `vocab` the run's tokenizer's vocabulary when the
    caller knows it (else the named tokenizer's, or the preset's); `shape` the config's resolved
    shape where the caller has it (the plan)."""
    from dr_scale.models.build import resolve_shape, vocab_for

    if vocab is None and cfg.model.vocab_size is None and cfg.data.tokenizer:
        from dr_scale.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    if shape is None:
        return resolve_shape(cfg.model, vocab)
    if vocab is not None:
        return dataclasses.replace(shape, vocab_size=vocab_for(cfg.model, vocab))
    return shape


def estimate_for_run(cfg, ds: dict, topology: Topology, device_type: str = "cpu",
                     vocab: int = None) -> MemoryEstimate:
    """The estimate of a run as configured (`dr-scale estimate`, the memory check)."""
    return estimate(shape_for_run(cfg, vocab), inputs_for_run(cfg, ds, topology, device_type))
