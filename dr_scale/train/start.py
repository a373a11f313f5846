"""What a run states at its start: the figures throughput is measured against (FLOPs per token,
the peak), the run folder's snapshot, and the start lines."""
import dataclasses
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dr_scale.config import ds_config as dsc
from dr_scale.config.snapshot import write_snapshot
from dr_scale.data.documents import DocumentBoundaries
from dr_scale.runtime.process_group import threads_per_rank
from dr_scale.models.build import count_parameters, spec_of
from dr_scale.parallel import zero3_gather
from dr_scale.runtime import slurm_lead
from dr_scale.train.engine import describe_optimizer
from dr_scale.train.peak_flops import Peak, largest_gemm, peak_flops


@dataclass
class RunFacts:
    """What throughput is measured against: model FLOPs per token (MFU), with recomputation
    (HFU), and this rank's peak."""
    parameters: int
    flops_per_token: float
    hardware_flops_per_token: float
    peak: Peak


def run_facts(model, shape, cfg, precision: str, device, batch_sizes, topo) -> RunFacts:
    """Counted from the shape; the peak measured now on CPU (before any data worker starts),
    at this rank's largest matmul of a micro-batch."""
    seq, p = cfg.data.seq_length, cfg.parallel
    spec = spec_of(shape.arch)
    fpt = spec.flops_per_token(shape, seq)
    hw = fpt + spec.recompute_flops_per_token(shape, seq, p.activation_checkpointing,
                                              p.checkpoint_every)
    gemm = largest_gemm(shape, batch_sizes["micro"] * seq, topo.tensor)
    return RunFacts(count_parameters(model), fpt, hw, peak_flops(precision, device, gemm))


def write_run_snapshot(plan, group, shape, facts: RunFacts, sources):
    """config.yaml, ds_config.json (as the engine got it) and run.json in the run folder, or in
    resumes/<time>/ on a resume; the tokenizer beside them on a fresh start."""
    t, resume = group.topology, plan.resume is not None
    snap_dir = group.run_dir / "resumes" / time.strftime("%Y%m%d-%H%M%S") if resume \
        else group.run_dir
    write_snapshot(snap_dir, plan.cfg, group.ds, {
        "world": {"world_size": t.world, "ranks_per_node": group.local_world,
                  "data_parallel": t.data, "tensor_parallel": t.tensor,
                  "pipeline_parallel": t.pipeline, "expert_parallel": t.expert,
                  "device": group.device.type,
                  "backend": dist.get_backend()},
        "model": {"shape": dataclasses.asdict(shape), "parameters": facts.parameters,
                  "flops_per_token": facts.flops_per_token,
                  "hardware_flops_per_token": facts.hardware_flops_per_token},
        "data": {"tokenizer": str(sources.tokenizer.path),
                 "tokenizer_sha256": sources.tokenizer.sha256,
                 "datasets": [{"prefix": d.indexed.prefix, "weight": float(w)}
                              for d, w in zip(sources.train.datasets, sources.train.weights)]},
        "batch": plan.deepspeed.batch,
        "peak_flops": {"value": facts.peak.value, "source": facts.peak.source}})
    if not resume:
        shutil.copyfile(sources.tokenizer.path, group.run_dir / sources.tokenizer.file_name)


def start_lines(plan, group, shape, facts: RunFacts, kernels_line: str, sources,
                offload_note=None, memory_note=None):
    """What rank 0 says before the first step: world, precision and why, model, batch, layout,
    kernels, optimizer, the peak, and warnings (bf16 emulated, data, host memory)."""
    t, c, deepspeed, ds = group.topology, plan.cfg, plan.deepspeed, group.ds
    b = deepspeed.batch
    why, warning = dsc.bf16_choice(deepspeed.raw, deepspeed.bf16, deepspeed.source)
    yield (f"dr_scale: {t.world} rank(s) ({group.local_world} on this node), "
           f"{group.device.type}, {dist.get_backend()}, ZeRO-{deepspeed.stage}, "
           f"{deepspeed.precision}{f' ({why})' if why else ''}; model {c.model.preset} "
           f"({shape.arch}) {facts.parameters / 1e6:.2f}M parameters"
           f"{experts_note(shape, facts)}; batch "
           f"{b['micro']} x {b['accum']} accumulation x {t.data} data-parallel = "
           f"{b['global']} x {c.data.seq_length} tokens; run folder {group.run_dir}")
    if warning:
        yield warning
    documents = DocumentBoundaries.of(c.data, sources.tokenizer)
    if documents.active:
        yield documents.describe()
    overlap = ds.get("zero_optimization", {}).get("overlap_comm", False)
    gathering = f"; {zero3_gather.describe(c.parallel.zero3_gather)}" \
        if deepspeed.stage == 3 else ""
    yield (f"layout: {t.describe()}{lm_head_note(t, c.parallel)}; {kernels_line}; "
           f"{describe_optimizer(ds, c.train)}; gradients reduced in "
           f"{dsc.reduction_dtype(ds)}, overlap_comm {str(overlap).lower()}{gathering}")
    threads = "" if group.device.type != "cpu" else \
        f"; {torch.get_num_threads()} thread(s) per rank " \
        f"({threads_per_rank(group.local_world)[1]})"
    yield f"peak (MFU's denominator): {facts.peak.value / 1e12:.3f} TFLOP/s per rank, " \
          f"{facts.peak.source}{threads}"
    if offload_note:
        yield f"offload: {offload_note}"
    if memory_note:
        yield f"host memory: {memory_note}"
    yield from slurm_lead.lead_lines(facts.parameters, 4 if deepspeed.precision == "fp32" else 2,
                                     max(1, t.world // group.local_world),
                                     c.train.checkpoint_write_gbps,
                                     # one scontrol call a job, not one a rank: rank 0 alone
                                     # prints these lines
                                     grace_s=slurm_lead.grace_time_s()
                                     if t.rank == 0 else None)
    yield from (f"warning: {w}" for w in sources.warnings)


def experts_note(shape, facts: RunFacts) -> str:
    """A mixture of experts: its active parameters, which FLOPs and MFU count."""
    if shape.moe is None:
        return ""
    active = spec_of(shape.arch).active_parameters(shape, facts.parameters)
    return (f" ({active / 1e6:.2f}M active: top-{shape.moe.top_k} of {shape.moe.num_experts} "
            f"experts; MFU counts 6 x active matmul parameters + 12 x layers x hidden x "
            f"sequence FLOPs per token)")


def lm_head_note(topo, parallel_cfg) -> str:
    if topo.tensor == 1:
        return ""
    if topo.pipeline > 1:
        return ", LM head replicated (vocab_parallel does not apply to pipeline stages)"
    note = ", LM head split by vocabulary" if parallel_cfg.vocab_parallel else ", LM head replicated"
    return note + (", sequence parallel" if parallel_cfg.sequence_parallel else "")
