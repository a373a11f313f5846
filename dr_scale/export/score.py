"""`dr-scale eval --hf FOLDER --run_dir RUN`: a transformers folder scored on a run's own
held-out samples, beside the run's last eval_loss.

The samples are the ones the trainer evaluates on (train/trainer.py eval_loss): the run's config,
tokenizer and data, its seed's split, its eval_samples, the usable count for its data-parallel
size; the loss is the mean token cross-entropy over them in fp32. An export that loads and
scores within a fraction of a percent of the run's own figure has its layout and names right
(a loss round trip cannot see a wrong position table on a small model: the build equivalence
tests do that).
"""
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError


@dataclass
class Score:
    loss: float
    samples: int
    tokens: int
    seconds: float
    run_loss: float   # the run's last eval_loss
    run_step: int

    @property
    def relative_difference(self) -> float:
        return abs(self.loss - self.run_loss) / abs(self.run_loss)

    def as_dict(self) -> dict:
        return {"eval_loss": self.loss, "samples": self.samples, "tokens": self.tokens,
                "tokens_per_s": self.tokens / self.seconds, "run_eval_loss": self.run_loss,
                "run_step": self.run_step, "relative_difference": self.relative_difference}


def last_eval(run_dir: Path) -> tuple:
    """(step, eval_loss) of the run's last held-out evaluation."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DrScaleError(f"{path}: not found; --run_dir takes a run folder")
    evals = [r for r in map(json.loads, path.read_text().splitlines()) if "eval_loss" in r]
    if not evals:
        raise DrScaleError(f"{path}: no eval_loss record; the run never evaluated")
    return evals[-1]["step"], evals[-1]["eval_loss"]


def held_out_samples(run_dir: Path):
    """The run's held-out stream, cut to the samples its evaluation uses, and the run's facts."""
    from dr_scale.config import load_config
    from dr_scale.data.loader import build_sources, resolve_files
    from dr_scale.data.tokenizer import file_sha256

    facts_path = run_dir / "run.json"
    if not facts_path.is_file():
        raise DrScaleError(f"{facts_path}: not found; --run_dir takes a run folder")
    facts = json.loads(facts_path.read_text())
    cfg = load_config(run_dir / "config.yaml", [])
    if cfg.data.document_mask or cfg.data.reset_positions:
        raise DrScaleError(f"{run_dir / 'config.yaml'}: data.document_mask / reset_positions: "
                           "the run evaluated with packed documents kept apart, which a "
                           "transformers model does not do; no like-for-like score")
    tokenizer_path, specs = resolve_files(cfg.data)
    if file_sha256(Path(tokenizer_path)) != facts["data"]["tokenizer_sha256"]:
        raise DrScaleError(f"{tokenizer_path}: not the tokenizer the run used "
                           f"({facts['data']['tokenizer']}); its held-out samples would differ")
    batch = facts["batch"]
    sources = build_sources(cfg.data, cfg.train.seed,
                            train_samples=cfg.train.max_steps * batch["global"],
                            eval_samples=cfg.train.eval_samples, tokenizer_path=tokenizer_path,
                            specs=specs)
    dp = facts["world"]["data_parallel"]
    return sources.valid, len(sources.valid) - len(sources.valid) % dp


def load_transformers_model(folder: Path, device: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise DrScaleError("dr-scale eval needs transformers: python -m pip install "
                           "transformers") from None
    if not (folder / "config.json").is_file():
        raise DrScaleError(f"{folder / 'config.json'}: not found; --hf takes a transformers "
                           "folder (dr-scale export writes one)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds on a bad folder
        raise DrScaleError(f"{folder}: transformers could not load it ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    return model.to(device).eval()


@torch.no_grad()
def score(hf_folder, run_dir, batch_size: int = 4, device: str = "cpu", progress=None) -> Score:
    """The folder's mean held-out token loss on the run's evaluation samples. `progress(done,
    total, tokens_per_s)` after each batch, if given."""
    hf_folder, run_dir = Path(hf_folder), Path(run_dir)
    run_step, run_loss = last_eval(run_dir)
    stream, usable = held_out_samples(run_dir)
    model = load_transformers_model(hf_folder, device)
    total, tokens, t0 = 0.0, 0, time.perf_counter()
    for start in range(0, usable, batch_size):
        batch = torch.stack([stream[i] for i in range(start, min(start + batch_size, usable))])
        batch = batch.to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        labels = batch[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum").item()
        tokens += labels.numel()
        if progress is not None:
            progress(min(start + batch_size, usable), usable,
                     tokens / (time.perf_counter() - t0))
    return Score(total / tokens, usable, tokens, time.perf_counter() - t0, run_loss, run_step)
