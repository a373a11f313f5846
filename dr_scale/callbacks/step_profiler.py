"""torch.profiler over a window of training steps: a Chrome/Perfetto trace per profiled rank, a
table of the most expensive operators and their totals as JSON (`*.ops.json`: each operator's
self time and calls, what benchmarks/step_profile.py sets beside the peer's), in
`<run>/profiles/`.

    callbacks:
      step_profiler: {enabled: true, start_step: 5, steps: 2, ranks: [0]}

The trainer marks its phases (dr_scale.forward, dr_scale.backward, dr_scale.optimizer_step) with
record_function, so the trace shows them as named ranges.
"""
from dataclasses import dataclass
from typing import List

import torch

from dr_scale.callbacks.base import Callback
from dr_scale.config.typed import Section, field
from dr_scale.registry import CALLBACK_REGISTRY


@dataclass
class StepProfilerOptions(Section):
    start_step: int = field(3, min=0, help="profile from this step")
    steps: int = field(2, min=1, help="for this many steps")
    ranks: List[int] = field(factory=lambda: [0], help="on these ranks")
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    table_rows: int = field(25, min=1, help="rows of the operator table")


@CALLBACK_REGISTRY.register("step_profiler")
class StepProfiler(Callback):
    name = "step_profiler"
    Options = StepProfilerOptions

    def __init__(self, start_step: int = 3, steps: int = 2, ranks=(0,), record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, table_rows: int = 25):
        o = self.options(start_step=start_step, steps=steps,
                         ranks=list(ranks) if isinstance(ranks, (list, tuple)) else ranks,
                         record_shapes=record_shapes, profile_memory=profile_memory,
                         with_stack=with_stack, table_rows=table_rows)
        self.start_step, self.steps, self.ranks = o.start_step, o.steps, set(o.ranks)
        self.profile_options = dict(record_shapes=o.record_shapes,
                                    profile_memory=o.profile_memory, with_stack=o.with_stack)
        self.table_rows = o.table_rows
        self.prof = None
        self.written = None  # (trace path, table path) once written

    def before_step(self, trainer, step):
        rank = trainer.topology.rank
        if step != self.start_step or rank not in self.ranks or self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, **self.profile_options)
        self.prof.__enter__()
        self.first, self.rank = step + 1, rank

    def after_step(self, trainer, step, record):
        if self.prof is not None and self.written is None and step >= self.start_step + self.steps:
            self._write(trainer, step)

    def on_exit(self, trainer):
        if self.prof is not None and self.written is None:  # the run ended inside the window
            self._write(trainer, trainer.step)

    def _write(self, trainer, last):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        out = trainer.run_dir / "profiles"
        out.mkdir(exist_ok=True)
        stem = f"steps_{self.first:06d}-{last:06d}_rank{self.rank}"
        trace, table = out / f"{stem}.trace.json", out / f"{stem}.txt"
        self.prof.export_chrome_trace(str(trace))
        write_operator_totals(self.prof, out / f"{stem}.ops.json", last - self.first + 1)
        sort = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
        table.write_text(self.prof.key_averages().table(sort_by=sort, row_limit=self.table_rows)
                         + "\n")
        self.written = (trace, table)
        print(f"dr_scale: step profile of steps {self.first}-{last} on rank {self.rank}: "
              f"{trace} (open in https://ui.perfetto.dev), {table}", flush=True)


def write_operator_totals(prof, path, steps: int):
    """Each operator's self time (device time where there is one, else CPU) and calls, per
    step, as JSON: {"steps": n, "device": bool, "operators": {name: {"self_ms", "calls"}}}."""
    import json

    rows = {}
    device = False
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0) or 0
        device = device or device_us > 0
        rows[e.key] = {"self_cpu_us": e.self_cpu_time_total, "self_device_us": device_us,
                       "calls": e.count}
    key = "self_device_us" if device else "self_cpu_us"
    operators = {name: {"self_ms": r[key] / 1e3 / steps, "calls": r["calls"] / steps}
                 for name, r in rows.items() if r[key] > 0}
    with open(path, "w") as f:
        json.dump({"steps": steps, "device": device, "operators": operators}, f, indent=1)
