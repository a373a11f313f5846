"""The experiment config: typed sections with their defaults (the embedded default run)."""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from dr_scale.config.typed import Section, field


@dataclass
class MoEConfig(Section):
    # Any field set here overrides the preset's (models/moe.py MoEShape).
    num_experts: Optional[int] = field(None, min=1, help="routed experts per MoE block")
    top_k: Optional[int] = field(None, min=1, help="experts each token is routed to")
    expert_ffn: Optional[int] = field(None, min=1, help="an expert's width (null: "
                                      "model.ffn_hidden_size)")
    shared_experts: Optional[int] = field(None, min=0, help="experts every token passes "
                                          "through (DeepSeek, Qwen-MoE)")
    shared_ffn: Optional[int] = field(None, min=1, help="the shared experts' width together "
                                      "(null: shared_experts x expert_ffn)")
    shared_gate: Optional[bool] = field(None, help="a sigmoid gate on the shared experts' "
                                        "output (Qwen-MoE)")
    dense_layers: Optional[int] = field(None, min=0, help="the first blocks keep a dense MLP "
                                        "of ffn_hidden_size")
    score: Optional[str] = field(None, choices=("softmax", "sigmoid"),
                                 help="the router's scores (softmax: Mixtral, Qwen; sigmoid: "
                                 "DeepSeek-V3)")
    route_norm: Optional[bool] = field(None, help="renormalise the chosen scores to sum to 1 "
                                       "(null: when top_k > 1)")
    route_scale: Optional[float] = field(None, min=0.0, help="scale of the routed output "
                                         "(DeepSeek-V3's routed_scaling_factor)")
    bias_update_rate: Optional[float] = field(
        None, min=0.0, help="auxiliary-loss-free balancing: each expert's routing bias moves "
        "by this toward the mean load after every step (DeepSeek-V3: 0.001); 0: off")
    expert_bias: Optional[bool] = field(None, help="the routing has a per-expert bias, saved "
                                        "and exported (null: where bias_update_rate > 0)")
    capacity_factor: Optional[float] = field(
        None, min=0.0, help="an expert takes at most factor x tokens x top_k / experts of a "
        "training micro-batch's assignments, the rest dropped (never at evaluation); null or "
        "0: drop-free")
    aux_loss_coeff: Optional[float] = field(None, min=0.0, help="load-balancing loss weight per "
                                            "MoE layer, the layers summed (Megatron's "
                                            "moe_aux_loss_coeff; default 0.01)")
    aux_loss_scope: Optional[str] = field(None, choices=("micro_batch", "sequence"),
                                          help="the balance measured over each micro-batch "
                                          "or each sequence (DeepSeek-V3)")
    z_loss_coeff: Optional[float] = field(None, min=0.0, help="router z-loss weight per MoE "
                                          "layer, summed (default 0.001)")


@dataclass
class ModelConfig(Section):
    # A preset names the shape; any field set here overrides the preset's value.
    preset: str = field("tiny", help="a registered family's preset (`dr-scale presets`)")
    arch: Optional[str] = field(None, help="a family in MODEL_REGISTRY, checked against it "
                                "when the shape is resolved")
    hidden_size: Optional[int] = field(None, min=1)
    num_layers: Optional[int] = field(None, min=1)
    num_heads: Optional[int] = field(None, min=1)
    num_kv_heads: Optional[int] = field(None, min=1)
    ffn_hidden_size: Optional[int] = field(None, min=1)
    vocab_size: Optional[int] = field(None, min=2, help="null: the tokenizer's, padded")
    max_seq_length: Optional[int] = field(None, min=1)
    tie_embeddings: Optional[bool] = None
    norm_eps: Optional[float] = field(None, min=0.0)
    rope_theta: Optional[float] = field(None, min=1.0)
    rope_scaling: Optional[Dict[str, Any]] = field(
        None, help="rotary frequency scaling, as Hugging Face writes it: {rope_type: llama3, "
        "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}")
    attention: str = field("sdpa", help="an attention kernel (sdpa, eager, triton_flash, ...), or "
                           "auto (best available)")
    kernels: Dict[str, str] = field(factory=dict, help="op -> implementation (default auto): "
                                    "rms_norm, layer_norm, swiglu, bias_gelu, rotary, cross_entropy")
    dropout: float = field(0.0, min=0.0, max=1.0)
    init_std: float = field(0.02, min=0.0)
    loss_chunk_tokens: Optional[int] = field(
        None, min=0, help="the LM head and cross-entropy fused, this many tokens at a time "
        "(the logits are never whole); null: the most whose fp32 logits fit 256 MiB; 0: "
        "unfused (whole logits, then model.kernels' cross_entropy)")
    pad_vocab_multiple: int = field(64, min=1)
    init_from: Optional[str] = field(None, help="Hugging Face folder to start from (a family "
                                     "whose ModelSpec has an HF format)")
    compile: Any = field(False, choices=[False, True, "auto"], help="torch.compile each decoder "
                         "block (regional compilation): false, true, or auto (one block "
                         "measured eager and compiled at the run's shapes, the faster kept)")
    moe: MoEConfig = field(factory=MoEConfig, help="mixture of experts (mixtral family)")


@dataclass
class DatasetSpec(Section):
    prefix: str = field(help="path of a .bin/.idx pair without the extension")
    weight: float = field(1.0, min=0.0)
    type: str = field("packed", help="how documents become samples: a name in DATASET_REGISTRY")


@dataclass
class DataConfig(Section):
    tokenizer: Optional[str] = field(None, help="sentencepiece .model, Hugging Face "
                                     "tokenizer.json, or a folder with one; null: trained on "
                                     "the corpus")
    tokenizer_vocab_size: int = field(4096, min=64, help="when a tokenizer is trained")
    datasets: List[DatasetSpec] = field(factory=list, help="empty: the bundled corpus")
    seq_length: int = field(256, min=8)
    valid_fraction: float = field(0.05, min=0.0, max=0.5)
    num_workers: int = field(0, min=0)
    document_mask: bool = field(False, help="a token attends only to earlier tokens of its own "
                                "packed document (end-of-document tokens mark the boundaries)")
    reset_positions: bool = field(False, help="positions restart at each packed document")
    cache_dir: str = field("${env:DR_SCALE_CACHE,~/.cache/dr_scale}")


@dataclass
class TrainConfig(Section):
    max_steps: int = field(400, min=1)
    micro_batch_size: int = field(8, min=1)
    global_batch_size: Optional[int] = field(None, min=1, help="null: micro x data-parallel")
    lr: float = field(3e-3, min=0.0)
    min_lr: float = field(3e-4, min=0.0)
    lr_schedule: str = field("cosine", help="name in SCHEDULE_REGISTRY")
    warmup_steps: int = field(40, min=0)
    lr_decay_steps: Optional[int] = field(None, min=1, help="null: max_steps")
    weight_decay: float = field(0.1, min=0.0)
    optimizer: str = field("auto", choices=["auto", "adamw", "muon"],
                           help="auto: the DeepSpeed JSON's optimizer section, else torch AdamW; "
                           "muon: DeepSpeed's Muon for the blocks' matrices, AdamW (lr, betas) "
                           "for the rest (parallel/muon.py)")
    muon_lr: float = field(0.02, min=0.0, help="Muon's peak learning rate (its half follows "
                           "the same schedule, scaled by muon_lr / lr)")
    muon_momentum: float = field(0.95, min=0.0, max=1.0)
    grad_clip: Optional[float] = field(None, min=0.0, help="0: off; null: 1.0 with AdamW, off "
                                       "with Muon (DeepSpeed would clip Muon's update, not the "
                                       "gradient: config/ds_config.check_muon)")
    seed: int = field(1234, min=0)
    log_interval: int = field(10, min=1)
    eval_interval: int = field(100, min=1)
    eval_at_start: bool = field(True, help="evaluate before the first step (a baseline point)")
    eval_samples: int = field(64, min=1, help="held-out samples per evaluation")
    save_interval: int = field(200, min=1)
    save_interval_minutes: Optional[float] = field(
        None, min=0.0, help="also save once this many minutes have passed since the last save "
        "(or the start): the work a failure loses, bounded in time whatever a step takes; "
        "null: by steps only")
    keep_checkpoints: int = field(3, min=0, help="keep the newest K checkpoints; 0 keeps all")
    async_save: bool = field(False, help="write checkpoints in the background while training "
                             "goes on")
    async_snapshot: bool = field(True, help="an asynchronous save copies the state to host "
                                 "memory first and the loop waits for the copy only; false: no "
                                 "copy, the loop waits before the next optimizer step")
    collective_timeout_s: int = field(600, min=5, help="a collective waiting longer ends the "
                                      "run in one line naming the rank and the phase")
    step_timeout_factor: float = field(10.0, min=1.0, help="a training step waiting longer than "
                                       "this many times the median step (and "
                                       "step_timeout_min_s) ends the run in one line naming the "
                                       "silent ranks (runtime/watchdog.py)")
    step_timeout_min_s: float = field(60.0, min=1.0, help="the shortest step deadline (the "
                                      "first steps, fast steps)")
    checkpoint_write_gbps: float = field(1.0, min=0.001, help="GB/s a node writes checkpoints "
                                         "at: sizes the SIGUSR1 lead a SLURM job needs "
                                         "(runtime/slurm_lead.py)")
    release_host_memory: bool = field(False, help="after each backward, return freed host "
                                      "memory to the OS (glibc malloc_trim), and give large "
                                      "tensors pages of their own: a lower peak RSS "
                                      "on CPU ranks for slower steps; not with pipeline stages "
                                      "(runtime/host_memory.py)")


@dataclass
class LoggingConfig(Section):
    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "dr_scale"
    wandb_mode: str = field("offline", choices=["offline", "online", "disabled"])
    plot: bool = True
    step_breakdown: bool = field(False, help="time forward / backward / optimizer step per "
                                 "step (synchronizes the device: for benchmarks)")


@dataclass
class ParallelConfig(Section):
    # Data parallel is what remains: world / (tensor_parallel x pipeline_parallel).
    tensor_parallel: int = field(1, min=1, help="ranks per tensor-parallel group (DeepSpeed AutoTP)")
    sequence_parallel: bool = field(False, help="with tensor_parallel > 1: norms and residuals "
                                    "on 1/TP of the sequence (Megatron-LM sequence parallelism)")
    pipeline_parallel: int = field(1, min=1, help="pipeline stages")
    expert_parallel: int = field(1, min=1, help="mixture of experts: ranks each block's experts "
                                 "are split over (a divisor of the data-parallel size; the "
                                 "tokens travel to their experts' ranks by all-to-all)")
    vocab_parallel: bool = field(True, help="with tensor_parallel > 1: split the LM head (and "
                                 "the tied embedding) by vocabulary, loss computed on the slices")
    activation_checkpointing: str = field("none", choices=["none", "full", "selective"],
                                          help="full: whole blocks; selective: attention only")
    checkpoint_every: int = field(1, min=1, help="checkpoint every k-th block")
    zero3_gather: str = field("block", choices=["block", "module"], help="ZeRO-3's unit of "
                              "gathering: block (each decoder block's parameters at once, as "
                              "FSDP wraps per block) or module (DeepSpeed's default: each "
                              "module's own, less gathered at a time, more hooks)")


@dataclass
class RunConfig(Section):
    model: ModelConfig = field(factory=ModelConfig)
    data: DataConfig = field(factory=DataConfig)
    train: TrainConfig = field(factory=TrainConfig)
    parallel: ParallelConfig = field(factory=ParallelConfig)
    logging: LoggingConfig = field(factory=LoggingConfig)
    callbacks: Dict[str, Any] = field(factory=dict, help="callbacks.<name>.enabled etc.")
    run_dir: Optional[str] = field(None, help="null: runs/<date>-<time>")
