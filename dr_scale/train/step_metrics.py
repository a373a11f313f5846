"""The figures of a training record: the window's loss over every rank, throughput (tokens/s,
model and hardware TFLOP/s per rank, MFU and HFU against the peak), the fullest rank's peak
memory. A figure that cannot be true is not printed: a utilisation the peak makes implausible
measures the peak again (train/peak_flops.py), and a peak still too low (MFU above 100%) is
reported unreliable, its MFU left out. Each record's MFU is its TFLOP/s over the peak it carries."""
from typing import Callable, List

import torch

from dr_scale.runtime import comm
from dr_scale.train.metrics import peak_memory_bytes


class StepMetrics:
    """`facts`: train.start.RunFacts (FLOPs per token with and without recomputation, this
    rank's peak); `log`: where a changed or unreliable peak is said (one line)."""

    def __init__(self, topology, facts, tokens_per_step: int, device_type: str,
                 log: Callable[[str], None]):
        self.world, self.device_type, self.log = topology.world, device_type, log
        self.flops_per_token = facts.flops_per_token
        self.hardware_flops_per_token = facts.hardware_flops_per_token
        self.peak, self.tokens_per_step = facts.peak, tokens_per_step

    def window(self, step: int, losses: List[torch.Tensor], seconds: float) -> dict:
        """The record's figures for `losses`, the mean losses of the window's steps (device
        tensors: averaged over all ranks in one collective), which took `seconds`."""
        mean = torch.stack(losses)
        comm.all_reduce(mean)
        mean = mean / self.world  # tensor-parallel ranks hold equal copies
        mem = torch.tensor([peak_memory_bytes(self.device_type)], dtype=torch.float64)
        comm.all_reduce(mem, "max")  # the fullest rank is the one that matters
        steps = len(losses)
        tokens_per_s = steps * self.tokens_per_step / seconds
        flops = tokens_per_s * self.flops_per_token / self.world
        hardware_flops = tokens_per_s * self.hardware_flops_per_token / self.world
        return {"step": step, "loss": mean.mean().item(), "tokens_per_s": tokens_per_s,
                "tflops": flops / 1e12, **self.utilisation(step, flops, hardware_flops),
                "peak_tflops": self.peak.value / 1e12, "step_time_s": seconds / steps,
                "mem_peak_bytes": int(mem.item())}

    def utilisation(self, step: int, flops: float, hardware_flops: float) -> dict:
        """{mfu, hfu} against the peak, checked first (HFU >= MFU, so HFU is the one that
        must stay at or below 1); {} once the peak is unreliable."""
        peak = self.peak
        was_reliable, was_remeasured, before = not peak.unreliable, peak.remeasured, peak.value
        hfu = hardware_flops / peak.value
        if not peak.check(hfu) and was_reliable:
            self.log(f"MFU not reported from step {step} on: above 100% even after measuring "
                     f"the peak again ({peak.source})")
        elif peak.remeasured and not was_remeasured:  # the start line's figure is replaced
            self.log(f"peak (MFU's denominator) measured again at step {step}: "
                     f"{peak.value / 1e12:.3f} TFLOP/s per rank, was {before / 1e12:.3f} (HFU "
                     f"{100 * hfu:.0f}% against it)")
        if peak.unreliable:
            return {}
        return {"mfu": flops / peak.value, "hfu": hardware_flops / peak.value}
