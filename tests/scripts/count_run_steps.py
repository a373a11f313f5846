"""Run by tests/test_plan.py: the launcher's run (one rank, as `python launchers/pretrain.py ARGS`)
with each start-up computation counted, written as JSON to OUT when the run leaves.

    python count_run_steps.py OUT ARGS...

The counted functions are wrapped before dr_scale.launch is imported, so every module that
imports them by name gets the counting one."""
import collections
import json
import sys

import dr_scale.callbacks.build
import dr_scale.config.ds_config
import dr_scale.models
import dr_scale.models.build
import dr_scale.parallel.parallelize
import dr_scale.train.reshard

calls = collections.Counter()


def counted(module, name, *also):
    plain = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        return plain(*args, **kwargs)
    for owner in (module, *also):
        setattr(owner, name, wrapper)


counted(dr_scale.config.ds_config, "fill")
counted(dr_scale.models.build, "resolve_shape", dr_scale.models)
counted(dr_scale.callbacks.build, "build_callbacks")
counted(dr_scale.parallel.parallelize, "refusals")
counted(dr_scale.train.reshard, "reshard_plan")

import dr_scale.launch  # noqa: E402  (after the wrappers)

plain_leave = dr_scale.launch.leave


def leave(code):
    with open(sys.argv[1], "w") as f:
        json.dump({"code": code, "calls": dict(calls)}, f)
    plain_leave(code)


dr_scale.launch.leave = leave
dr_scale.launch.main(sys.argv[2:])
