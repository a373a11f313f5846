"""Building the model so that no rank ever holds all of it.

Under ZeRO-3 (without tensor or pipeline parallelism) the model is constructed inside
DeepSpeed's `zero.Init`: each submodule's parameters are cast to the training precision and
partitioned across the data-parallel ranks as soon as that submodule exists, so a rank holds one
module whole at most while building, then its 1/N shard. Initialisation draws each tensor whole,
one at a time (models/layers.py `whole`), so the values are those of an unsharded build from the
same seed. Everywhere else every rank builds the whole model, as DeepSpeed expects there (AutoTP
splits the built linears; a pipeline keeps its stage's layers of the built model).
"""
from torch import nn

from dr_scale import ds_config as dsc
from dr_scale.models import build_model
from dr_scale.parallel.topology import Topology


def builds_sharded(ds: dict, topo: Topology) -> bool:
    return dsc.zero_stage(ds) == 3 and topo.tensor == 1 and topo.pipeline == 1


def build_for_run(shape, ds: dict, topo: Topology) -> nn.Module:
    if not builds_sharded(ds, topo):
        return build_model(shape)
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds):
        return build_model(shape)
