"""Where metrics go: console (rank 0), metrics.jsonl, TensorBoard, wandb. A missing optional
package or an unreachable service is reported once and never stops a run."""
import json
import os
import resource
import secrets
import sys
from pathlib import Path

from dr_scale.units import format_bytes


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this rank since the last `reset_peak_memory`: accelerator allocations on a
    GPU, resident set size on CPU (VmHWM; the process's lifetime peak where /proc has none)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_memory(device_type: str):
    """Start the peak anew (before the first step): start-up's measurements (peak FLOPs, the
    kernel choice) hold buffers the training never holds. On CPU writing 5 to
    /proc/self/clear_refs sets VmHWM to the current resident size (Linux)."""
    if device_type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def console_line(rec: dict, max_steps: int) -> str:
    if "eval_loss" in rec:
        ema = f" | EMA loss {rec['ema_eval_loss']:.4f}" if "ema_eval_loss" in rec else ""
        return (f"eval  step {rec['step']:>6}/{max_steps} | loss {rec['eval_loss']:.4f} | "
                f"ppl {rec['eval_ppl']:.2f}{ema}")
    mfu = f"MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "MFU n/a (peak unreliable)"
    return (f"train step {rec['step']:>6}/{max_steps} | loss {rec['loss']:.4f} | "
            f"lr {rec['lr']:.3e} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['tflops']:.3f} TFLOP/s | {mfu} | mem {format_bytes(rec['mem_peak_bytes'])}"
            + (f" | grad norm {rec['grad_norm']:.3f}" if "grad_norm" in rec else "")
            + (f" | clipped {rec['clipped_params']:.1f}" if "clipped_params" in rec else "")
            + (router_figures(rec) if "aux_loss" in rec else ""))


def router_figures(rec: dict) -> str:
    """A mixture of experts' routing (models/moe.py): its losses, the busiest expert's load
    over the mean in the worst layer, the assignments dropped by the capacity."""
    return (f" | aux {rec['aux_loss']:.3f} | z {rec['z_loss']:.3f} | expert load max/mean "
            f"{max(rec['expert_load']):.2f} | dropped {100 * rec['tokens_dropped']:.1f}%")


WANDB_ID_FILE = "wandb_run_id"


class MetricsLogger:
    """Only rank 0 writes; other ranks hold a disabled logger."""

    def __init__(self, run_dir, logging_cfg, max_steps: int, enabled: bool, run_name: str = "",
                 resume_step=None):
        self.enabled, self.max_steps, self.cfg = enabled, max_steps, logging_cfg
        self.jsonl = self.tb = self.wandb = None
        if not enabled:
            return
        self.run_dir, self.resume_step, self.run_name = Path(run_dir), resume_step, run_name
        self._opened = False

    def _open(self):
        """Sinks open at the first record, so a resume that fails before training writes
        nothing into the run folder."""
        self._opened = True
        cfg, run_dir, resume_step = self.cfg, self.run_dir, self.resume_step
        if cfg.jsonl:
            if resume_step is not None:
                set_aside_records_after(run_dir, resume_step)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step drops events logged after the checkpoint by the interrupted run
                self.tb = SummaryWriter(str(run_dir / "tensorboard"),
                                        purge_step=None if resume_step is None else resume_step + 1)
            except ImportError as e:
                self.note(f"TensorBoard logging off ({e}); pip install tensorboard")
        if cfg.wandb and cfg.wandb_mode != "disabled":
            try:
                import wandb

                self.wandb = self._wandb_run(wandb, cfg, run_dir, resume_step)
            except Exception as e:  # noqa: BLE001 - any wandb failure must not kill the run
                self.note(f"wandb logging off ({type(e).__name__}: {e})")

    def _wandb_run(self, wandb, cfg, run_dir: Path, resume_step):
        """One training run is one wandb run: its id is kept in the run folder. A resume
        continues it from the checkpoint's step (wandb's `resume_from="<id>?_step=<step>"`): the
        history after that step, logged by the interrupted run, is cut, and the steps logged
        again are kept (resumed by id alone, wandb drops every step at or below the last one it
        has). Where the server refuses to rewind (a preview feature of wandb's), the run resumes
        by id, and the note says which steps wandb will drop."""
        id_file = run_dir / WANDB_ID_FILE
        known = id_file.is_file()
        run_id = id_file.read_text().strip() if known else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        common = dict(project=cfg.wandb_project, name=self.run_name, dir=str(run_dir),
                      mode=cfg.wandb_mode)
        if resume_step is None or not known:
            return wandb.init(id=run_id, resume="allow", **common)
        try:
            return wandb.init(resume_from=f"{run_id}?_step={resume_step}", **common)
        except Exception as e:  # noqa: BLE001
            self.note(f"wandb could not rewind run {run_id} to step {resume_step} "
                      f"({type(e).__name__}: {e}); resumed by id: steps the interrupted run "
                      f"logged after {resume_step} keep their first values")
            return wandb.init(id=run_id, resume="allow", **common)

    def note(self, text: str):
        if self.enabled:
            print(f"[dr_scale] {text}", file=sys.stderr, flush=True)

    def info(self, text: str):
        if self.enabled and self.cfg.console:
            print(text, flush=True)

    def _emit(self, rec: dict, line: str) -> bool:
        """Console line and JSONL record; False on ranks that do not log."""
        if not self.enabled:
            return False
        if not self._opened:
            self._open()
        if self.cfg.console:
            print(line, flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        return True

    def log(self, rec: dict):
        """A training or evaluation record: also to TensorBoard and wandb."""
        if not self._emit(rec, console_line(rec, self.max_steps)):
            return
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

    def log_event(self, rec: dict):
        """A record that is neither training nor evaluation (skipped steps, alerts)."""
        self._emit(rec, f"event step {rec.get('step')}: " + ", ".join(
            f"{k}={v}" for k, v in rec.items() if k != "step"))

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


def set_aside_records_after(run_dir: Path, step: int):
    """On resume: records the interrupted run logged after its last checkpoint are re-logged by
    the resumed run; move them to metrics.superseded.jsonl so each step appears once."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep, drop = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (drop if json.loads(line).get("step", 0) > step else keep).append(line)
    if drop:
        with open(run_dir / "metrics.superseded.jsonl", "a") as f:
            f.write("".join(l + "\n" for l in drop))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        os.replace(tmp, path)


def read_metrics(path) -> list:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            out = [json.loads(line) for line in f if line.strip()]
    return out
