import math

import pytest
import torch

from dr_scale.config import load_config
from dr_scale.errors import DrScaleError
from dr_scale.train.schedule import build_scheduler, check_schedule, lr_at


def cfg(*o):
    return load_config(overrides=["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=10",
                                  "train.max_steps=110", *o]).train


@pytest.mark.parametrize("kind, mid, end", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1),
                                            ("constant", 1.0, 1.0)])
def test_warmup_then_decay(kind, mid, end):
    t = cfg(f"train.lr_schedule={kind}")
    assert lr_at(t, 0) == pytest.approx(0.1)       # first warmup step
    assert lr_at(t, 9) == pytest.approx(1.0)       # warmup ends at the peak
    assert lr_at(t, 60) == pytest.approx(mid)      # halfway through the decay
    assert lr_at(t, 110) == pytest.approx(end)
    assert lr_at(t, 500) == pytest.approx(end)     # past the end: stays at min_lr


def test_cosine_shape():
    t = cfg()
    assert lr_at(t, 35) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))


def test_scheduler_drives_an_optimizer():
    t = cfg()
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_scheduler(opt, t)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(t, s) for s in range(12)])


def test_unknown_schedule_lists_known():
    with pytest.raises(DrScaleError, match=r"^train.lr_schedule: unknown lr schedule 'cyclic'; "
                       r"known: constant, cosine, linear"):
        check_schedule(cfg("train.lr_schedule=cyclic"))
