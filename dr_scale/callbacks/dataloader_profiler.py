"""Where the input pipeline's time goes: fetch (reading samples), collate (stacking them), waiting
(the training loop blocked on the next batch) and host-to-device copy.

    with DataLoaderProfiler(device) as prof:
        for batch in prof.wrap(loader):   # batches come out already on `device`
            ...
    print(prof.summary())

Fetch and collate are timed where they run (in the worker processes when num_workers > 0, where
they overlap training; their times travel back with each batch). Waiting and the copy are timed in
the training process; only they are time the training loop loses.
"""
import time

import torch
import torch.utils.data

from dr_scale.callbacks.base import Callback
from dr_scale.registry import CALLBACK_REGISTRY

STAGES = ("fetch", "collate", "wait", "h2d")


class _TimedBatch:
    """A batch with the fetch and collate seconds of the process that built it."""

    def __init__(self, batch, fetch_s, collate_s):
        self.batch, self.fetch_s, self.collate_s = batch, fetch_s, collate_s


class _TimedDataset(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset
        self.fetch_s = 0.0  # since the last collate, in this process

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        t0 = time.perf_counter()
        item = self.dataset[index]
        self.fetch_s += time.perf_counter() - t0
        return item


class _TimedCollate:
    def __init__(self, dataset: _TimedDataset, collate):
        self.dataset, self.collate = dataset, collate

    def __call__(self, items):
        t0 = time.perf_counter()
        batch = self.collate(items)
        collate_s = time.perf_counter() - t0
        fetch_s, self.dataset.fetch_s = self.dataset.fetch_s, 0.0
        return _TimedBatch(batch, fetch_s, collate_s)


class DataLoaderProfiler:
    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else None
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.batches = 0
        self.wall_s = 0.0
        self._t0 = None

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_s += time.perf_counter() - self._t0
        return False

    def instrument(self, loader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        """The same loader (dataset, sampler, workers) with fetch and collate timed."""
        timed = _TimedDataset(loader.dataset)
        collate = loader.collate_fn or torch.utils.data.default_collate
        return torch.utils.data.DataLoader(
            timed, batch_sampler=loader.batch_sampler, num_workers=loader.num_workers,
            collate_fn=_TimedCollate(timed, collate), pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers)

    def wrap(self, loader):
        """Iterate an instrumented copy of `loader`, yielding batches moved to the device."""
        it = iter(self.instrument(loader))
        while True:
            t0 = time.perf_counter()
            try:
                timed = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            batch = timed.batch if self.device is None else self._to_device(timed.batch)
            t2 = time.perf_counter()
            self.record(fetch=timed.fetch_s, collate=timed.collate_s, wait=t1 - t0, h2d=t2 - t1)
            yield batch

    def _to_device(self, batch):
        batch = batch.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copy's real duration
        return batch

    def record(self, **seconds):
        for stage, s in seconds.items():
            self.totals[stage] += s
        self.batches += 1

    def stats(self) -> dict:
        n = max(1, self.batches)
        wall = self.wall_s or (time.perf_counter() - self._t0 if self._t0 else 0.0)
        return {"batches": self.batches, "wall_s": wall,
                **{f"{s}_s": self.totals[s] for s in STAGES},
                **{f"{s}_ms_per_batch": 1e3 * self.totals[s] / n for s in STAGES},
                "loop_share_lost": (self.totals["wait"] + self.totals["h2d"]) / wall if wall else 0.0}

    def summary(self) -> str:
        st = self.stats()
        wall = st["wall_s"] or 1.0
        rows = [f"{'stage':<8} {'total s':>9} {'ms/batch':>9} {'% of wall':>9}  where"]
        where = {"fetch": "loader process(es)", "collate": "loader process(es)",
                 "wait": "training loop", "h2d": "training loop"}
        for s in STAGES:
            rows.append(f"{s:<8} {st[f'{s}_s']:>9.3f} {st[f'{s}_ms_per_batch']:>9.2f} "
                        f"{100 * st[f'{s}_s'] / wall:>8.1f}%  {where[s]}")
        rows.append(f"{st['batches']} batches in {wall:.2f} s; the training loop lost "
                    f"{100 * st['loop_share_lost']:.1f}% of it to the input pipeline")
        return "\n".join(rows)


@CALLBACK_REGISTRY.register("dataloader_profiler")
class DataLoaderProfilerCallback(Callback):
    """Times the training loader; each record carries `data_wait_ms` (per batch) and the summary
    table is printed and written to `dataloader_profile.json` at the end."""

    name = "dataloader_profiler"

    def __init__(self):
        self.profiler = None

    def wrap_loader(self, trainer, loader):
        self.profiler = DataLoaderProfiler(trainer.device).__enter__()
        self._reported = (0.0, 0)
        return self.profiler.wrap(loader)

    def after_backward(self, trainer, step, micro_step):
        last_micro = micro_step == trainer.batch_sizes["accum"] - 1
        if self.profiler is None or not last_micro or not trainer.will_log(step + 1):
            return
        p = self.profiler
        wait, n = p.totals["wait"] + p.totals["h2d"], p.batches
        prev_wait, prev_n = self._reported
        if n > prev_n:  # the window since the last record
            trainer.report("data_wait_ms", 1e3 * (wait - prev_wait) / (n - prev_n))
        self._reported = (wait, n)

    def on_exit(self, trainer):
        if self.profiler is None:
            return
        import json

        self.profiler.__exit__(None, None, None)
        trainer.logger.info("data-loader profile (rank 0):\n" + self.profiler.summary())
        if trainer.logger.enabled:
            (trainer.run_dir / "dataloader_profile.json").write_text(
                json.dumps(self.profiler.stats(), indent=2) + "\n")
