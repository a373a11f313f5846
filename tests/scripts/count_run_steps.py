"""Run by tests/test_plan.py: the launcher's run (as `python launchers/pretrain.py ARGS`, or one
rank of it under torchrun) with each start-up computation counted, written as JSON to OUT (OUT.N
on rank N of several) when the run leaves: {"code": exit code, "calls": {name: count}}.

    python count_run_steps.py OUT ARGS...

The counted functions are wrapped before dr_scale.launch is imported, and wherever a module
imported earlier holds them by name, so every caller gets the counting one."""
import collections
import json
import os
import sys

import dr_scale.callbacks.build
import dr_scale.config.ds_config
import dr_scale.data.loader
import dr_scale.data.tokenizer
import dr_scale.models
import dr_scale.models.build
import dr_scale.parallel.parallelize
import dr_scale.parallel.tensor
import dr_scale.parallel.topology
import dr_scale.runtime.nvme_offload
import dr_scale.runtime.process_group
import dr_scale.checkpoint.reshard

calls = collections.Counter()


def counted(module, name):
    plain = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        return plain(*args, **kwargs)
    for owner in [m for m in list(sys.modules.values()) if m is not None]:
        if getattr(owner, "__name__", "").startswith("dr_scale") and \
                getattr(owner, name, None) is plain:
            setattr(owner, name, wrapper)


counted(dr_scale.config.ds_config, "fill")
counted(dr_scale.config.ds_config, "batch_sizes")
counted(dr_scale.models.build, "resolve_shape")
counted(dr_scale.callbacks.build, "build_callbacks")
counted(dr_scale.parallel.parallelize, "refusals")
counted(dr_scale.parallel.tensor, "autotp_section")
counted(dr_scale.parallel.tensor, "check_divisible")
counted(dr_scale.data.loader, "dataset_types")
counted(dr_scale.data.tokenizer, "load_tokenizer")
counted(dr_scale.runtime.nvme_offload, "fill_paths")
counted(dr_scale.runtime.process_group, "init_distributed")
counted(dr_scale.checkpoint.reshard, "reshard_plan")
Topology = dr_scale.parallel.topology.Topology
plain_from_config = Topology.from_config.__func__


def from_config(cls, *args, **kwargs):
    calls["Topology.from_config"] += 1
    return plain_from_config(cls, *args, **kwargs)


Topology.from_config = classmethod(from_config)

import dr_scale.launch  # noqa: E402  (after the wrappers)

plain_leave = dr_scale.launch.leave


def leave(code):
    out = sys.argv[1] + (f".{os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1
                         else "")
    with open(out, "w") as f:
        json.dump({"code": code, "calls": dict(calls)}, f)
    plain_leave(code)


dr_scale.launch.leave = leave
dr_scale.launch.main(sys.argv[2:])
