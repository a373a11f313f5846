"""Memory: a monitor that samples host RSS and accelerator memory per rank and draws
memory.png, and an alert that warns when use passes a threshold.

    monitor = MemoryMonitor()
    monitor.sample(step)          # {"step", "host_rss_bytes", "device_bytes", "device_peak_bytes"}
    monitor.plot("memory.png")
    trainer.register_callback(MemoryAlertCallback(max_usage="80%"))
"""
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from dr_scale.runtime import comm
from dr_scale.callbacks.base import Callback
from dr_scale.config.typed import Section, field
from dr_scale.errors import DrScaleError
from dr_scale.registry import CALLBACK_REGISTRY

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _on_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def device_total_bytes() -> int:
    """What a percentage threshold is a percentage of: the GPU's memory, or the host's RAM."""
    if _on_gpu():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return psutil.virtual_memory().total


def current_usage_bytes() -> int:
    if _on_gpu():
        return torch.cuda.memory_reserved()
    return psutil.Process().memory_info().rss


def parse_threshold(value) -> int:
    """'80%', '12GiB', '500 MB' or a number of bytes -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", text)
        if m and 0 < float(m.group(1)) <= 100:
            return int(device_total_bytes() * float(m.group(1)) / 100)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
        if m and m.group(2) in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise DrScaleError(f"max_usage: expected a percentage ('80%'), a size ('12GiB') or bytes, "
                       f"got {value!r}")


class MemoryMonitor:
    def __init__(self):
        self.samples = []

    def sample(self, step=None) -> dict:
        rec = {"step": step if step is not None else len(self.samples),
               "host_rss_bytes": psutil.Process().memory_info().rss,
               "device_bytes": torch.cuda.memory_allocated() if _on_gpu() else 0,
               "device_peak_bytes": torch.cuda.max_memory_allocated() if _on_gpu() else 0}
        self.samples.append(rec)
        return rec

    def plot(self, path, samples_by_rank=None) -> Path:
        import matplotlib.pyplot as plt

        fig = self.figure(samples_by_rank)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return Path(path)

    def figure(self, samples_by_rank=None):
        """memory over steps: host RSS in MiB (and accelerator memory on a GPU, a second axes),
        one line per rank in rank order."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        by_rank = samples_by_rank or {0: self.samples}
        gpu = any(s["device_bytes"] for ss in by_rank.values() for s in ss)
        fig, axes = plt.subplots(1, 2 if gpu else 1, figsize=(11 if gpu else 6, 4), squeeze=False)
        for rank, ss in sorted(by_rank.items()):
            steps = [s["step"] for s in ss]
            axes[0][0].plot(steps, [s["host_rss_bytes"] / 2**20 for s in ss], label=f"rank {rank}")
            if gpu:
                axes[0][1].plot(steps, [s["device_bytes"] / 2**20 for s in ss], label=f"rank {rank}")
        axes[0][0].set(xlabel="step", ylabel="MiB", title="Host resident memory")
        if gpu:
            axes[0][1].set(xlabel="step", ylabel="MiB", title="Accelerator memory allocated")
        for ax in axes[0]:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        return fig


@dataclass
class MemoryMonitorOptions(Section):
    every: int = field(1, min=1, help="sample every this many steps")


@CALLBACK_REGISTRY.register("memory_monitor")
class MemoryMonitorCallback(Callback):
    """Samples every `every` steps on every rank; rank 0 writes memory.png at the end."""

    name = "memory_monitor"
    Options = MemoryMonitorOptions

    def __init__(self, every: int = 1):
        self.every, self.monitor = self.options(every=every).every, MemoryMonitor()

    def on_train_start(self, trainer):
        self.monitor.sample(trainer.step)

    def after_step(self, trainer, step, record):
        if step % self.every == 0:
            self.monitor.sample(step)

    def on_exit(self, trainer):
        gathered = comm.all_gather_object(self.monitor.samples)
        if trainer.topology.rank == 0:
            out = self.monitor.plot(trainer.run_dir / "memory.png", dict(enumerate(gathered)))
            trainer.logger.info(f"wrote {out}")


@dataclass
class MemoryAlertOptions(Section):
    max_usage: Any = field("80%", help="'80%' of the device (or host), '12GiB', or bytes")
    every: int = field(100, min=1, help="repeat the warning at most every this many steps")


@CALLBACK_REGISTRY.register("memory_alert")
class MemoryAlertCallback(Callback):
    """Warns when this rank's memory passes `max_usage`: once, then every `every` steps."""

    name = "memory_alert"
    Options = MemoryAlertOptions

    def __init__(self, max_usage="80%", every: int = 100):
        every = self.options(max_usage=max_usage, every=every).every
        try:
            self.threshold = parse_threshold(max_usage)
        except DrScaleError as e:
            raise DrScaleError(f"callbacks.memory_alert.{e}") from None
        self.max_usage, self.every = max_usage, every
        self.last_alert = None
        self.alerts = 0

    def after_step(self, trainer, step, record):
        used = current_usage_bytes()
        if used <= self.threshold:
            return
        if self.last_alert is not None and step - self.last_alert < self.every:
            return
        self.last_alert = step
        self.alerts += 1
        print(f"[dr_scale] memory alert (rank {trainer.topology.rank}, step {step}): "
              f"{used / 2**20:,.0f} MiB in use > max_usage {self.max_usage} "
              f"({self.threshold / 2**20:,.0f} MiB)", file=sys.stderr, flush=True)
        trainer.logger.log_event({"step": step, "memory_alert": True, "rank": trainer.topology.rank,
                                  "usage_bytes": used, "threshold_bytes": self.threshold})
