"""Learning-rate schedules: linear warmup, then cosine, linear or constant down to min_lr."""
import math

import torch

from dr_scale.errors import DrScaleError
from dr_scale.registry import SCHEDULE_REGISTRY


def _decay_fraction(step, warmup, decay_steps):
    return min(1.0, max(0.0, (step - warmup) / max(1, decay_steps - warmup)))


@SCHEDULE_REGISTRY.register("cosine")
def cosine(step, lr, min_lr, warmup, decay_steps):
    if step < warmup:
        return lr * (step + 1) / warmup
    f = _decay_fraction(step, warmup, decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * f))


@SCHEDULE_REGISTRY.register("linear")
def linear(step, lr, min_lr, warmup, decay_steps):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr - (lr - min_lr) * _decay_fraction(step, warmup, decay_steps)


@SCHEDULE_REGISTRY.register("constant")
def constant(step, lr, min_lr, warmup, decay_steps):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr


def lr_at(train_cfg, step: int) -> float:
    fn = SCHEDULE_REGISTRY.get(train_cfg.lr_schedule)
    return fn(step, train_cfg.lr, train_cfg.min_lr, train_cfg.warmup_steps,
              train_cfg.lr_decay_steps or train_cfg.max_steps)


def check_schedule(train_cfg):
    """An unknown train.lr_schedule, refused in the plan."""
    try:
        SCHEDULE_REGISTRY.get(train_cfg.lr_schedule)
    except DrScaleError as e:
        raise DrScaleError(f"train.lr_schedule: {e}") from None


def build_scheduler(optimizer, train_cfg):
    """A LambdaLR stepping once per optimizer step; DeepSpeed saves and restores its state."""
    base = train_cfg.lr or 1.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(train_cfg, step) / base)
