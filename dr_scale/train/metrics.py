"""Where metrics go: console (rank 0), metrics.jsonl, TensorBoard, wandb. A missing optional
package or an unreachable service is reported once and never stops a run."""
import json
import os
import resource
import sys
from pathlib import Path


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this rank: accelerator allocations on a GPU, resident set size on CPU."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def console_line(rec: dict, max_steps: int) -> str:
    if "eval_loss" in rec:
        return (f"eval  step {rec['step']:>6}/{max_steps} | loss {rec['eval_loss']:.4f} | "
                f"ppl {rec['eval_ppl']:.2f}")
    return (f"train step {rec['step']:>6}/{max_steps} | loss {rec['loss']:.4f} | "
            f"lr {rec['lr']:.3e} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['tflops']:.3f} TFLOP/s | MFU {100 * rec['mfu']:.1f}% | "
            f"mem {format_bytes(rec['mem_peak_bytes'])}")


class MetricsLogger:
    """Only rank 0 writes; other ranks hold a disabled logger."""

    def __init__(self, run_dir, logging_cfg, max_steps: int, enabled: bool, run_name: str = ""):
        self.enabled, self.max_steps, self.cfg = enabled, max_steps, logging_cfg
        self.jsonl = self.tb = self.wandb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        if logging_cfg.jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
        if logging_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError as e:
                self.note(f"TensorBoard logging off ({e}); pip install tensorboard")
        if logging_cfg.wandb and logging_cfg.wandb_mode != "disabled":
            try:
                import wandb

                self.wandb = wandb.init(project=logging_cfg.wandb_project, name=run_name,
                                        dir=str(run_dir), mode=logging_cfg.wandb_mode,
                                        resume="allow")
            except Exception as e:  # noqa: BLE001 - any wandb failure must not kill the run
                self.note(f"wandb logging off ({type(e).__name__}: {e})")

    def note(self, text: str):
        if self.enabled:
            print(f"[dr_scale] {text}", file=sys.stderr, flush=True)

    def info(self, text: str):
        if self.enabled and self.cfg.console:
            print(text, flush=True)

    def log(self, rec: dict):
        if not self.enabled:
            return
        if self.cfg.console:
            print(console_line(rec, self.max_steps), flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        scalars = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb:
            prefix = "eval" if "eval_loss" in rec else "train"
            for k, v in scalars.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, rec["step"])
        if self.wandb:
            try:
                self.wandb.log(scalars, step=rec["step"])
            except Exception as e:  # noqa: BLE001
                self.note(f"wandb logging off ({type(e).__name__}: {e})")
                self.wandb = None

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            try:
                self.wandb.finish()
            except Exception:  # noqa: BLE001
                pass


def read_metrics(path) -> list:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            out = [json.loads(line) for line in f if line.strip()]
    return out
