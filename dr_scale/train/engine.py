"""deepspeed.initialize, with DeepSpeed's own config complaints turned into one line, and
torch's AdamW built from `train.*` where the DeepSpeed JSON names no optimizer."""
from typing import Optional

import torch

from dr_scale.config.ds_config import MUON, optimizer_type
from dr_scale.errors import DrScaleError
from dr_scale.parallel import muon
from dr_scale.parallel.optimizer_groups import param_groups
from dr_scale.parallel.zero3_hooks import hooks_without_gathering

# Betas of the optimizer built when the DeepSpeed JSON has none: torch's (and Hugging Face
# Trainer's) defaults; the bundled configs say 0.95 for the second, as Llama's recipe does.
DEFAULT_BETAS = (0.9, 0.999)


def default_optimizer(ds: dict, groups, train_cfg) -> Optional[torch.optim.Optimizer]:
    """torch AdamW from `train.*` when `ds` has no `optimizer` section (users' own JSON often
    has none; DeepSpeed would stop with "zero stage 1 requires an optimizer"); None otherwise."""
    if "optimizer" in ds:
        return None
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=DEFAULT_BETAS, eps=1e-8,
                             weight_decay=train_cfg.weight_decay)


def describe_optimizer(ds: dict, train_cfg) -> str:
    if optimizer_type(ds) == MUON:
        p = ds["optimizer"]["params"]
        return (f"optimizer DeepSpeed Muon (the blocks' matrices: lr {p['muon_lr']:g}, momentum "
                f"{p['momentum']:g}, Newton-Schulz {p['ns_method']} in {p['ns_dtype']}; the rest "
                f"AdamW: "
                f"lr {p['lr']:g}, betas {p['betas'][0]}/{p['betas'][1]}; weight decay "
                f"{p['weight_decay']:g})")
    if "optimizer" in ds:
        return f"optimizer {ds['optimizer'].get('type', '?')} (DeepSpeed config)"
    return (f"optimizer torch AdamW from train.* (lr {train_cfg.lr:g}, weight decay "
            f"{train_cfg.weight_decay:g}, betas {DEFAULT_BETAS[0]}/{DEFAULT_BETAS[1]}; the "
            f"DeepSpeed config has no optimizer section)")


def check_precision(precision: str, ds_path):
    """bf16 or fp16 where DeepSpeed's accelerator here cannot train in it (the plan)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    supported = {"bf16": acc.is_bf16_supported, "fp16": acc.is_fp16_supported}
    if precision in supported and not supported[precision]():
        alternative = "a bf16 config such as zero2" if precision == "fp16" else "an fp16 config"
        raise DrScaleError(f"{ds_path}: {precision}.enabled: {precision} is not supported on the "
                           f"{acc.device_name()} accelerator here; use {alternative}")


def _dotted_path(ds: dict, loc) -> str:
    """DeepSpeed validates sections separately, so its error path lacks the section: find it."""
    def search(node, prefix):
        if not isinstance(node, dict):
            return None
        probe = node
        for part in loc:
            if not isinstance(probe, dict) or part not in probe:
                probe = None
                break
            probe = probe[part]
        if probe is not None:
            return prefix + ".".join(loc)
        for k, v in node.items():
            hit = search(v, f"{prefix}{k}.")
            if hit:
                return hit
        return None

    return search(ds, "") or ".".join(loc)


def check_with_deepspeed(ds: dict, ds_path):
    """DeepSpeed's own validation of the filled config (its pydantic sections, its sanity
    checks), in the plan. Its batch check counts the process group's world (a world of one
    before any exists): the global batch is left out, for DeepSpeed to derive from the
    micro-batch and accumulation (the plan has checked it against the data-parallel size)."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)  # its "world_size = 1" note would be every rank's line
    try:
        DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    except (ValueError, AssertionError) as e:
        raise _as_one_line(e, ds, ds_path) from None
    finally:
        logger.setLevel(level)


def _as_one_line(e: Exception, ds: dict, ds_path) -> DrScaleError:
    errors = getattr(e, "errors", None)  # pydantic's ValidationError is a ValueError
    if callable(errors) and errors():
        first = errors()[0]
        where = _dotted_path(ds, [str(x) for x in first.get("loc", ())])
        return DrScaleError(f"{ds_path}: {where}: {first.get('msg')} (DeepSpeed)")
    return DrScaleError(f"{ds_path}: DeepSpeed rejected the config: "
                        f"{(str(e).splitlines() or [type(e).__name__])[0]}")


def initialize_engine(model, ds: dict, train_cfg, scheduler, ds_path, mpu=None,
                      tensor_group=None):
    """The DeepSpeed engine around `model` (plain or a PipelineModule). Muon (parallel/muon.py)
    is built here from the JSON's section, which DeepSpeed then does not see."""
    import deepspeed

    if optimizer_type(ds) == MUON:
        muon.tag(model, tensor_group)
        settings = ds["optimizer"]["params"]
        groups = param_groups(model, train_cfg.weight_decay, muon=settings)
        optimizer = muon.build(groups, settings)
        ds = {k: v for k, v in ds.items() if k != "optimizer"}
    else:
        groups = param_groups(model, train_cfg.weight_decay)
        optimizer = default_optimizer(ds, groups, train_cfg)
    try:
        with hooks_without_gathering():  # ZeRO-3: no all-gather of the model at start
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=groups if optimizer is None else None,
                optimizer=optimizer, config=ds, lr_scheduler=scheduler, mpu=mpu)
    except ValueError as e:  # a config the plan's check_with_deepspeed let through
        raise _as_one_line(e, ds, ds_path) from None
    return engine
