"""The optimizer's parameter groups: what a DeepSpeed engine is built with, and so the order its
checkpoints keep the fp32 master copies in (export/consolidate.py reads them in this order)."""
from dr_scale.parallel.expert import expert_groups


def param_groups(model, weight_decay: float):
    """No weight decay on vectors (norm weights, biases). A parameter built sharded (ZeRO-3's
    zero.Init) is a 1-D placeholder: its own shape is in ds_shape."""
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731
    decay = [p for p in model.parameters() if ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if ndim(p) < 2]
    return expert_groups([{"params": decay, "weight_decay": weight_decay, "name": "decay"},
                          {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])
