"""The optimizer's parameter groups: what a DeepSpeed engine is built with, and so the order its
checkpoints keep the fp32 master copies in (export/consolidate.py reads them in this order)."""
from typing import Optional

from dr_scale.parallel.expert import expert_groups


def param_groups(model, weight_decay: float, muon: Optional[dict] = None):
    """No weight decay on vectors (norm weights, biases). A parameter built sharded (ZeRO-3's
    zero.Init) is a 1-D placeholder: its own shape is in ds_shape. `muon`: the JSON's Muon
    settings (parameters tagged by parallel/muon.tag): the matrices Muon steps in a group of
    their own first, then the AdamW half's matrices and vectors; empty groups left out."""
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731
    decay = [p for p in model.parameters() if ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if ndim(p) < 2]
    if muon is None:
        return expert_groups([{"params": decay, "weight_decay": weight_decay, "name": "decay"},
                              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])
    from dr_scale.parallel.muon import group_settings, sorted_for_muon

    muon_half, adam_half = group_settings(muon, True), group_settings(muon, False)
    groups = [{"params": sorted_for_muon([p for p in decay if p.use_muon]),
               "weight_decay": weight_decay, "name": "decay-muon", **muon_half},
              {"params": [p for p in decay if not p.use_muon], "weight_decay": weight_decay,
               "name": "decay-adamw", **adam_half},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay-adamw", **adam_half}]
    return expert_groups([g for g in groups if g["params"]])
