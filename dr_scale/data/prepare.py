"""The data of a run: what the plan knows of it before anything is read or built (`plan_data`:
the named tokenizer, loaded once; the datasets, their types and files checked; a resumed run's
tokenizer compared), and the data step after the process group (`prepare_data`: the bundled
corpus built where it is used, the train and held-out streams)."""
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from dr_scale.data import corpus
from dr_scale.data.indexed import paths
from dr_scale.data.loader import build_sources, dataset_types
from dr_scale.data.tokenizer import file_sha256, load_tokenizer, tokenizer_file_in
from dr_scale.errors import DrScaleError


@dataclass(frozen=True)
class DataPlan:
    tokenizer: Any  # the tokenizer data.tokenizer names, loaded; None: trained on the bundled corpus
    specs: Tuple[Tuple[str, float, str], ...]  # (prefix, weight, type) each; (): the bundled corpus

    @property
    def vocab_size(self) -> Optional[int]:
        """The run's vocabulary where the plan knows it (a named tokenizer)."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else None


def plan_data(data_cfg, resumed_run_dir: Optional[Path] = None) -> DataPlan:
    """Everything about the data a config can get wrong, before any process group."""
    specs = ()
    if data_cfg.datasets and data_cfg.tokenizer is None:
        raise DrScaleError("data.tokenizer: required when data.datasets is set (the tokenizer "
                           "the datasets were made with)")
    tokenizer = load_tokenizer(data_cfg.tokenizer) if data_cfg.tokenizer else None
    if data_cfg.datasets:
        dataset_types(data_cfg)
        for i, d in enumerate(data_cfg.datasets):
            for p in paths(d.prefix)[:2]:
                if not p.is_file():
                    raise DrScaleError(f"data.datasets[{i}].prefix: {p}: dataset file not found "
                                       "(expected a .bin/.idx pair made by `dr-scale preprocess`)")
        specs = tuple((d.prefix, d.weight, d.type) for d in data_cfg.datasets)
    plan = DataPlan(tokenizer, specs)
    if resumed_run_dir is not None:
        check_resumed_tokenizer(resumed_run_dir, plan, data_cfg)
    return plan


def check_resumed_tokenizer(run_dir: Path, plan: DataPlan, data_cfg):
    """A resumed run keeps its tokenizer: token ids would change meaning. The tokenizer trained
    on the bundled corpus is compared with the cached one where it was built on this file
    system, else by the one setting it depends on (its vocabulary size)."""
    used = tokenizer_file_in(run_dir)
    if used is None:
        return
    if plan.tokenizer is not None:
        same, given = file_sha256(used) == plan.tokenizer.sha256, data_cfg.tokenizer
    else:
        given = "the tokenizer trained on the bundled corpus"
        built = corpus.bundled_folder(data_cfg.cache_dir, data_cfg.tokenizer_vocab_size) \
            / corpus.SENTENCEPIECE_FILE
        if built.is_file():
            same = file_sha256(used) == file_sha256(built)
        else:
            same = load_tokenizer(used).vocab_size == data_cfg.tokenizer_vocab_size
            given += f" with data.tokenizer_vocab_size={data_cfg.tokenizer_vocab_size}"
    if not same:
        raise DrScaleError(f"{used}: the run was trained with this tokenizer, but the resumed "
                           f"config gives {given}; token ids would change meaning")


def prepare_data(cfg, data: DataPlan, batch_sizes, resume_at=(0, 0)):
    """Tokenizer + train/held-out streams. What is built once (the bundled corpus on first use,
    the sample index caches) the first process to need it builds under a file lock while the
    others wait for it there, outside any collective (data/index_cache.py), then they read what
    it wrote. `resume_at` (step, samples consumed) sizes the stream for the steps left at this
    run's global batch."""
    t = cfg.train
    step, consumed = resume_at
    train_samples = consumed + max(0, t.max_steps - step) * batch_sizes["global"]
    tokenizer, specs = data.tokenizer, data.specs
    if not specs:
        tokenizer_file, prefix = corpus.bundled_data(cfg.data.cache_dir,
                                                     cfg.data.tokenizer_vocab_size, tokenizer)
        tokenizer = tokenizer or tokenizer_file
        specs = ((str(prefix), 1.0, "packed"),)
    return build_sources(cfg.data, t.seed, train_samples=train_samples,
                         eval_samples=t.eval_samples, tokenizer_path=tokenizer, specs=specs)
