"""Refuse before building: when the estimate for the configured run exceeds what a rank has
(the GPU's memory, or on CPU the node's available memory shared by its ranks), the launcher stops
in one line with the estimate, the limit and the cheapest change that fits, before any rank
allocates the model. `--skip_memory_check` for those who know better.

On a CPU rank that keeps freed pages (train.release_host_memory off) the estimate must fit with
KEPT_PAGES to spare, and handing them back is the first change named.

Cheapest first: ZeRO-3 (same machines, more communication), or under ZeRO-3 its working sets
made smaller (the step's fp32 gradient a sub-group of zero3's size at a time: free; at most
1e8 gathered parameters kept live: more all-gathers), activation checkpointing (about a third
more compute), optimizer offload to host memory (slower steps), optimizer state on NVMe (slower
still), then more ranks (more machines).
"""
import dataclasses
import os
from typing import Optional

from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.models.build import pad_vocab
from dr_scale.parallel.estimate import estimate, inputs_for_run, shape_for_run
from dr_scale.parallel.topology import Topology
from dr_scale.runtime.ranks import local_rank
from dr_scale.units import format_bytes


LIVE = 1e8  # gathered parameters ZeRO-3 keeps live (DeepSpeed's default: 1e9)
# A CPU rank without train.release_host_memory: glibc keeps freed pages that the estimate takes
# as given back. Measured peaks over the estimate: 1.06x (llama_1b cut to 8 layers, bundled
# zero3, 2 and 4 ranks, bf16), 1.16x with stage3_max_live_parameters 1e8, and a rank killed for
# memory at 1.04x of an estimate that had passed this check (fp32, 4 ranks). Since freed blocks
# are kept for reuse on CPU ranks (runtime/host_memory.py): 1.32x (llama_125m, zero3, 2 ranks,
# bf16), 1.56x (tiny with a 32,000 vocabulary, zero1, 2 ranks, bf16).
KEPT_PAGES = 1.6


def _short(count: float) -> str:
    """5e7, 1e8: as a DeepSpeed config would write them."""
    return f"{count:.0e}".replace("e+0", "e").replace("e+", "e")


def run_vocab(cfg) -> Optional[int]:
    """The vocabulary the run will have, as far as it is known before the data is read."""
    if cfg.model.vocab_size is not None or cfg.data.tokenizer:
        return None  # estimate_for_run reads these itself
    if not cfg.data.datasets:  # the bundled corpus, with the tokenizer trained on it
        return pad_vocab(cfg.data.tokenizer_vocab_size, cfg.model.pad_vocab_multiple)
    return None


def rank_limit(device_type: str, topology: Topology) -> tuple:
    """(bytes one rank may use, what that is) on this node."""
    if device_type == "cuda":
        import torch

        local = local_rank() % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(local)
        return props.total_memory, f"{format_bytes(props.total_memory)} on the {props.name}"
    from dr_scale.runtime.node_memory import available_bytes

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world))
    available = available_bytes(ranks_here)  # one figure for the node's ranks
    return available // ranks_here, (f"{format_bytes(available)} of host memory available, "
                                     f"shared by {ranks_here} rank(s) on this node")


def refuse_if_too_big(cfg, ds: dict, topology: Topology, device_type: str, source: str,
                      shape=None, vocab: int = None):
    """The refusal, with the cheapest change that fits; `shape`: the config's resolved shape,
    and `vocab` the named tokenizer's vocabulary, where the caller has them (the plan)."""
    shape = shape_for_run(cfg, run_vocab(cfg) if vocab is None else vocab, shape)
    inputs = inputs_for_run(cfg, ds, topology, device_type)
    need = estimate(shape, inputs).peak
    limit, what = rank_limit(device_type, topology)
    kept = device_type == "cpu" and not cfg.train.release_host_memory
    margin = KEPT_PAGES if kept else 1.0
    if need * margin <= limit:
        return
    stage = dsc.zero_stage(ds)
    fixes = []
    if kept:  # freed pages handed back: the estimate as it is (a few % of step time)
        fixes.append(("train.release_host_memory=true", dict(margin=1.0)))
    if stage < 3:
        fixes.append(("ZeRO-3 (--ds_config zero3)", dict(zero_stage=3)))
    else:
        smaller = {}
        bundled = dsc.sub_group_size(dsc.read_json(dsc.resolve_path("zero3")))  # one place
        if dsc.sub_group_size(ds) > bundled:
            smaller["sub_group_size"] = bundled
            fixes.append((f"zero_optimization.sub_group_size {_short(bundled)}", dict(smaller)))
        live = ds.get("zero_optimization", {}).get("stage3_max_live_parameters", 1e9)
        if float(live) > LIVE:
            smaller["max_live_parameters"] = LIVE
            fixes.append((f"zero_optimization.stage3_max_live_parameters and "
                          f"stage3_max_reuse_distance {_short(LIVE)}", dict(smaller)))
    if cfg.parallel.activation_checkpointing != "full":
        fixes.append(("parallel.activation_checkpointing=full", dict(checkpointing="full")))
    fixes.append(("optimizer and parameter offload to host memory (--ds_config zero3_offload)",
                  dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")))
    fixes.append(("optimizer state on NVMe (--ds_config zero3_nvme)",
                  dict(zero_stage=3, offload_optimizer="nvme", sub_group_size=2e7)))
    # more of them: GPUs each bring their memory; CPU ranks share their node's, so there more
    # ranks on this node leave each less, and the change that helps is more nodes like it
    more_of = "nodes" if device_type == "cpu" else "ranks"
    for factor in (2, 4, 8, 16, 32, 64):
        more = topology.with_world(topology.world * factor)
        name = (f"{factor}x the nodes ({more.world} ranks, as many a node as now) with ZeRO-3"
                if more_of == "nodes" else f"{more.world} ranks with ZeRO-3")
        fixes.append((name, dict(zero_stage=3, topology=more)))
    cheapest = f"none of ZeRO-3, checkpointing, offload or 64x the {more_of} fits"
    for name, change in fixes:
        fix_margin = change.pop("margin", margin)
        fits = estimate(shape, dataclasses.replace(inputs, **change))
        if fits.peak * fix_margin <= limit:
            cheapest = f"cheapest change that fits: {name} ({format_bytes(fits.peak)} a rank)"
            break
    kept_note = (f", x{KEPT_PAGES:g} for the freed pages glibc keeps without "
                 f"train.release_host_memory" if kept else "")
    raise DrScaleError(
        f"{source}: estimated peak {format_bytes(need)} a rank (`dr-scale estimate`{kept_note}) "
        f"exceeds {format_bytes(limit)} a rank ({what}); {cheapest}; --skip_memory_check "
        f"starts anyway")
