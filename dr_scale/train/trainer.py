"""The training loop over a DeepSpeed engine: the cadence of a run (log, evaluate, save, stop
signals) around the steps its engine kind runs (train/step_runner.py). What a record's figures
are is train/step_metrics.py's, what the held-out loss is train/evaluator.py's, what a checkpoint
holds its owners' (checkpoint/state.py)."""
import contextlib
import math
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from dr_scale.data.documents import DocumentBoundaries
from dr_scale.data.loader import train_loader
from dr_scale.errors import Preempted
from dr_scale.checkpoint import load as checkpoint_load
from dr_scale.checkpoint.layout import WrittenLayout
from dr_scale.checkpoint.state import RandomGenerators, SavedState
from dr_scale.checkpoint.writer import CheckpointWriter
from dr_scale.callbacks.base import CallbackList, CallbackState
from dr_scale.runtime import hangs
from dr_scale.runtime.watchdog import Watchdog
from dr_scale.runtime.preemption import StopSignals
from dr_scale.train import step_runner
from dr_scale.compat.grads import data_parallel_group
from dr_scale.train.evaluator import Evaluator
from dr_scale.train.expert_balance import ExpertBalance
from dr_scale.train.metrics import reset_peak_memory
from dr_scale.train.step_metrics import StepMetrics


class Trainer:
    def __init__(self, plan, group, engine, sources, logger, facts):
        """`plan`: dr_scale.plan.RunPlan; `group`: its Group (this rank's Topology, device, run
        folder); `sources`: data.loader.DataSources; `logger`: train.metrics.MetricsLogger;
        `facts`: train.start.RunFacts (FLOPs per token with and without recomputation, this
        rank's peak)."""
        cfg, topology = plan.cfg, group.topology
        self.engine, self.cfg, self.sources = engine, cfg, sources
        self.batch_sizes = batch_sizes = plan.deepspeed.batch
        self.topology, self.device = topology, group.device
        self.dp_size, self.dp_rank = topology.data, topology.data_rank
        self.run_dir, self.logger = Path(group.run_dir), logger
        self.stop_at_step = plan.stop_at_step  # an invocation's exit point, not the config's
        self.resume_plan = plan.resume
        self.last_loss = None         # the latest micro-batch loss (a tensor), for callbacks
        self.last_checkpoint = None   # path of the latest complete checkpoint
        self.callbacks = CallbackList(plan.callbacks)
        self._reported = {}  # name -> values reported by callbacks since the last train record
        self.stop = None     # the step this invocation ends at (set by fit)
        self.step = 0  # optimizer steps done (the schedule, max_steps and intervals count these)
        self.consumed_samples = 0  # the data position: samples read so far, on all ranks
        self._last_save = time.monotonic()  # (train.save_interval_minutes count from here)
        self.documents = DocumentBoundaries.of(cfg.data, sources.tokenizer)
        self.steps = step_runner.for_topology(  # plain or pipeline engine
            topology, engine, self.device, batch_sizes["accum"], self.documents,
            step_runner.StepHooks(self.phase, self._loss_seen, self._after_backward,
                                  self._before_update, self.report),
            cfg.train.release_host_memory)
        self._phase_s = dict.fromkeys(self.steps.phases, 0.0)
        self.metrics = StepMetrics(topology, facts, batch_sizes["global"] * cfg.data.seq_length,
                                   self.device.type, logger.info)
        self.evaluator = Evaluator(engine, sources.valid, batch_sizes["micro"], topology,
                                   self.device, self.steps)
        self.model_signature = engine.module.shape.weights_signature()
        # the routers' biases, where auxiliary-loss-free balancing is on
        self.balance = ExpertBalance.of(engine.module, topology, data_parallel_group(engine))
        self.writer = CheckpointWriter(engine, self.run_dir / "checkpoints", topology,
                                       cfg.train.keep_checkpoints, cfg.train.async_save,
                                       cfg.train.collective_timeout_s, cfg.train.async_snapshot)
        self.saved = SavedState({  # what a checkpoint holds beside DeepSpeed's files, by owner
            "trainer": self, "rng": RandomGenerators(),
            "layout": WrittenLayout(topology, self.model_signature,
                                    engine.zero_sub_group_size(), plan.deepspeed.optimizer),
            "callbacks": CallbackState(self.callbacks, self, logger.info)})

    def register_callback(self, callback):
        self.callbacks.add(callback)

    def report(self, name: str, value):
        """Add a figure to the next training record: numbers (tensors stay on the device, no
        host sync until the record) are averaged over the window, a vector element-wise (a
        list in the record); anything else, the latest."""
        self._reported.setdefault(name, []).append(value)

    def will_log(self, step: int) -> bool:
        """Whether the record for optimizer step `step` (1-based) is written."""
        return step % self.cfg.train.log_interval == 0 or step == self.stop

    def _drain_reports(self) -> dict:
        out = {}
        for name, values in self._reported.items():
            if all(isinstance(v, (int, float, torch.Tensor)) for v in values):
                mean = torch.stack([torch.as_tensor(v, dtype=torch.float32).cpu()
                                    for v in values]).mean(0)
                out[name] = mean.item() if mean.dim() == 0 else mean.tolist()
            else:
                out[name] = values[-1]
        self._reported = {}
        return out

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    # -- what a step tells the loop (step_runner.StepHooks) ------------------------------------
    def _loss_seen(self, loss):
        self.last_loss = loss

    def _after_backward(self, micro: int):
        if self.balance is not None:
            self.balance.after_backward()
        self.callbacks.fire("after_backward", self, self.step, micro)

    def _before_update(self):
        with hangs.doing(f"step {self.step + 1}: waiting for checkpoint writes"):
            self.writer.before_update()  # they read the weights the step now changes
        if self.balance is not None:  # (the routing biases too: after the writes)
            with hangs.doing(f"step {self.step + 1}: the experts' load"):
                self.balance.before_update()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The trainer's own entries of a checkpoint (checkpoint/state.py): its position."""
        return {"step": self.step, "consumed_samples": self.consumed_samples,
                "global_batch": self.batch_sizes["global"]}

    def load_state_dict(self, saved: dict):
        self.step = int(saved["step"])
        self.consumed_samples = int(saved["consumed_samples"])

    def _save_due(self) -> bool:
        """train.save_interval_minutes have passed on this rank's clock since the last save."""
        minutes = self.cfg.train.save_interval_minutes
        return minutes is not None and time.monotonic() - self._last_save >= 60 * minutes

    def save_checkpoint(self):
        self._last_save = time.monotonic()
        with hangs.doing(f"checkpoint save at step {self.step}"):
            self._saved(self.writer.wait())  # the one in flight, if any, first
            done = self.writer.save(self.step, self.saved.state_dict())
        if done is None:
            self.logger.info(f"writing checkpoint of step {self.step} in the background")
        self._saved(done)

    def finish_checkpoint(self):
        """Wait for an asynchronous save still in flight (before the run ends or stops)."""
        with hangs.doing("checkpoint save (finishing the asynchronous write)"):
            self._saved(self.writer.wait())

    def _saved(self, done):
        if done is None:
            return
        step, path, waited = done
        self.last_checkpoint = path
        self.logger.info(f"saved checkpoint {path} (the training loop waited {waited:.2f} s "
                         "for it)")
        self.callbacks.fire("on_checkpoint", self, step, path)

    def resume(self):
        with hangs.doing("checkpoint load"):
            state, path = checkpoint_load.load(self.engine, self.run_dir / "checkpoints",
                                               self.topology, self.model_signature,
                                               self.resume_plan.mode,
                                               self.engine.zero_optimization_stage(),
                                               tag=self.resume_plan.tag)
        self.saved.load_state_dict(state)
        self.last_checkpoint = path
        was = int(state.get("global_batch", self.batch_sizes["global"]))
        change = (f"; global batch {was} -> {self.batch_sizes['global']} samples, the data continues "
                  f"at the next sample and the schedule at the next step"
                  if was != self.batch_sizes["global"] else "")
        self.logger.info(f"resumed from {path} at step {self.step} "
                         f"({self.consumed_samples} samples consumed{change})")
        self.callbacks.fire("on_resume", self, self.step, path)

    # -- evaluation ----------------------------------------------------------------------------
    def eval_loss(self) -> float:
        """Mean held-out token loss over all data-parallel ranks, with the current weights."""
        return self.evaluator.loss()[0]

    def evaluate(self) -> dict:
        with hangs.doing(f"evaluation at step {self.step}"):
            eval_loss, tokens = self.evaluator.loss()
        rec = {"step": self.step, "eval_loss": eval_loss,
               "eval_ppl": math.exp(min(eval_loss, 50.0)), "eval_tokens": tokens}
        self.callbacks.fire("on_evaluate", self, self.step, rec)  # callbacks may add fields
        self.logger.log(rec)
        return rec

    # -- training ------------------------------------------------------------------------------
    def fit(self):
        t = self.cfg.train
        stop = self.stop = min(t.max_steps, self.stop_at_step or t.max_steps)
        signals = StopSignals()
        self.watchdog = Watchdog.for_run(self.topology, t, self.run_dir).start()
        try:
            self._fit(t, stop, signals)
        finally:
            self.watchdog.close()
        signals.restore()  # after a stop signal they stay noted: the ranks are leaving together

    def _fit(self, t, stop, signals):
        reset_peak_memory(self.device.type)  # mem_peak_bytes: the training's, not start-up's
        self.callbacks.fire("on_train_start", self)
        if self.step == 0 and t.eval_at_start:
            self.evaluate()
        loader = train_loader(self.sources.train, self.batch_sizes, self.dp_size, self.dp_rank,
                              self.consumed_samples, stop - self.step, self.cfg.data.num_workers)
        for cb in self.callbacks.callbacks:
            loader = cb.wrap_loader(self, loader)
        batches = iter(loader)
        window_losses, window_start = [], time.perf_counter()
        while self.step < stop:
            hangs.now(f"step {self.step + 1}")
            self.watchdog.begin(self.step + 1, f"step {self.step + 1}")
            self.callbacks.fire("before_step", self, self.step)
            lr = self.current_lr()
            window_losses.append(self.steps.train_step(batches))
            self.step += 1
            self.consumed_samples += self.batch_sizes["global"]
            record = None
            if self.will_log(self.step):
                with hangs.doing(f"step {self.step} metrics"):
                    record = self._train_record(window_losses,
                                                time.perf_counter() - window_start, lr)
                self.logger.log(record)
                window_losses, window_start = [], time.perf_counter()
            with hangs.doing(f"step {self.step} callbacks (after_step)"):
                self.callbacks.fire("after_step", self, self.step, record)
            self.watchdog.end()
            if self.step % t.eval_interval == 0 or self.step == t.max_steps:
                self.evaluate()
                window_start = time.perf_counter()  # evaluation time is not training throughput
            saved = self.step % t.save_interval == 0 or self.step == stop
            if saved:
                self.save_checkpoint()
                window_start = time.perf_counter()
            else:  # the first step's done: every state a save holds exists
                with hangs.doing(f"step {self.step} preparing the asynchronous save's buffers"):
                    self.writer.prepare_snapshot(self.saved.state_dict)
            hangs.now(f"step {self.step} stop-signal agreement")
            self.watchdog.begin(self.step, f"step {self.step} stop-signal agreement",
                                timed=False)
            # every rank, every step: they stop at the same one, see a save finish at one, and
            # save by time at one
            signal_name, written, save_due = signals.agreed(
                idle_here=self.writer.idle(), save_due_here=not saved and self._save_due())
            self.watchdog.end()
            if written:
                self._saved(self.writer.wait())
            if save_due:
                self.save_checkpoint()
                saved, window_start = True, time.perf_counter()
            if signal_name and self.step < stop:
                if not saved:
                    self.save_checkpoint()
                self.finish_checkpoint()
                self.callbacks.fire("on_exit", self)
                raise Preempted(f"{signal_name} at step {self.step}: checkpoint "
                                f"{self.last_checkpoint} saved; the same command with "
                                f"--resume auto continues")
        self.finish_checkpoint()
        self.writer.finish_deletes()  # the run's end, not a stop: a stop leaves them for later
        self.callbacks.fire("on_exit", self)

    @contextlib.contextmanager
    def phase(self, name):
        """A named range for profilers; with logging.step_breakdown, also its wall time (the
        device is synchronized around it, so only benchmarks switch it on)."""
        timed = self.cfg.logging.step_breakdown
        if timed:
            self._sync()
            t0 = time.perf_counter()
        with record_function(f"dr_scale.{name}"), hangs.doing(f"step {self.step + 1} {name}"):
            yield
        if timed:
            self._sync()
            self._phase_s[name] += time.perf_counter() - t0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _breakdown(self, steps) -> dict:
        if not self.cfg.logging.step_breakdown:
            return {}
        out = {f"time_{k}_s": v / steps for k, v in self._phase_s.items()}
        self._phase_s = dict.fromkeys(self._phase_s, 0.0)
        return out

    def _train_record(self, window_losses, seconds, lr) -> dict:
        """The window's figures (step_metrics.py), the data position, what callbacks reported."""
        return {**self.metrics.window(self.step, window_losses, seconds), "lr": lr,
                "consumed_samples": self.consumed_samples,
                "consumed_tokens": self.consumed_samples * self.cfg.data.seq_length,
                "skipped_steps": int(self.engine.skipped_steps),
                **self._breakdown(len(window_losses)), **self._grad_norm(),
                **self._drain_reports()}

    def _grad_norm(self) -> dict:
        """DeepSpeed's global norm of the last step's gradients (computed when it clips)."""
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return {}
        return {"grad_norm": float(norm)}
