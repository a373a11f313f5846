"""Train and held-out loaders for a data-parallel rank, with a resumable position."""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List

import torch

from dr_scale.data.corpus import bundled_data
from dr_scale.data.dataset import SampleStream, split_documents
from dr_scale.data.index_cache import IndexCache, cache_folder, content_identity, key_of
from dr_scale.data.indexed import IndexedDataset, paths
from dr_scale.data.tokenizer import load_tokenizer
from dr_scale.errors import DrScaleError
from dr_scale.registry import DATASET_REGISTRY


@dataclass
class DataSources:
    tokenizer: object  # data.tokenizer.load_tokenizer: sentencepiece or Hugging Face
    train: SampleStream
    valid: SampleStream
    warnings: List[str]  # one line each, for the start of the run


def dataset_types(data_cfg):
    """Each configured dataset's builder, by `type` (checked before anything is read)."""
    out = []
    for i, d in enumerate(data_cfg.datasets):
        try:
            out.append(DATASET_REGISTRY.get(d.type))
        except DrScaleError as e:
            raise DrScaleError(f"data.datasets[{i}].type: {e}") from None
    return out


def resolve_files(data_cfg):
    """(tokenizer path, [(prefix, weight, type)]): the configured ones or the bundled corpus."""
    if data_cfg.datasets:
        if data_cfg.tokenizer is None:
            raise DrScaleError("data.tokenizer: required when data.datasets is set (the "
                               "tokenizer the datasets were made with)")
        dataset_types(data_cfg)
        return data_cfg.tokenizer, [(d.prefix, d.weight, d.type) for d in data_cfg.datasets]
    tok, prefix = bundled_data(data_cfg.cache_dir, data_cfg.tokenizer_vocab_size,
                               data_cfg.tokenizer)
    return tok, [(str(prefix), 1.0, "packed")]


def _dataset_cache(prefix, kind, data_cfg, seed) -> IndexCache:
    """The index cache of one dataset, keyed by the files' content and every setting its arrays
    depend on: found beside its files or under data.cache_dir, else made beside the files (or
    under data.cache_dir when that folder is read-only)."""
    bin_path, idx_path, _ = paths(prefix)
    key = key_of(content_identity(idx_path), content_identity(bin_path), kind,
                 data_cfg.seq_length, seed, data_cfg.valid_fraction)
    beside = Path(f"{prefix}.index")
    for found in (beside / key, Path(os.path.expanduser(data_cfg.cache_dir)) / "indices" / key):
        if found.is_dir():
            return IndexCache(found)
    return IndexCache(cache_folder(beside, data_cfg.cache_dir, key))


def build_sources(data_cfg, seed: int, train_samples: int, eval_samples: int,
                  tokenizer_path=None, specs=None) -> DataSources:
    """The train and held-out streams. Their index arrays are read from caches, built there
    once by whichever process comes first (see data/index_cache.py). `tokenizer_path`: its file,
    or the tokenizer already loaded (the run's plan loads it once)."""
    if tokenizer_path is None:
        tokenizer_path, specs = resolve_files(data_cfg)
    tokenizer = load_tokenizer(tokenizer_path) if isinstance(tokenizer_path, (str, Path)) \
        else tokenizer_path
    train_sets, valid_sets, weights, valid_weights, keys, warnings = [], [], [], [], [], []
    for prefix, weight, kind in specs:
        # builder(indexed, doc ids, seq_length, seed, name, cache)
        make = DATASET_REGISTRY.get(kind)
        cache = _dataset_cache(prefix, kind, data_cfg, seed)
        indexed = IndexedDataset(prefix, check_contents=False)
        cache.stamp("contents_checked", indexed.check_contents)
        warning = indexed.check_tokenizer(tokenizer)
        if warning:
            warnings.append(warning)
        train_ids, valid_ids = split_documents(indexed.num_documents, data_cfg.valid_fraction,
                                               seed, prefix, cache)
        train_sets.append(make(indexed, train_ids, data_cfg.seq_length, seed,
                               f"{prefix} (train split)", cache=cache.child("train")))
        weights.append(weight)
        keys.append(cache.folder and cache.folder.name)
        if len(valid_ids):
            valid_sets.append(make(indexed, valid_ids, data_cfg.seq_length, seed,
                                   f"{prefix} (held-out split)", cache=cache.child("valid")))
            valid_weights.append(weight)
    if not valid_sets:
        raise DrScaleError("data.valid_fraction: 0 leaves no held-out split to evaluate on; "
                           "expected a fraction > 0")
    eval_samples = min(eval_samples, sum(len(d) for d in valid_sets))
    blends = Path(os.path.expanduser(data_cfg.cache_dir)) / "indices"

    def blend_cache(*parts):
        return IndexCache(blends / f"blend-{key_of(*parts)}")
    train = SampleStream(train_sets, weights, seed, train_samples,
                         blend_cache(keys, weights, seed, train_samples))
    valid = SampleStream(valid_sets, valid_weights, seed + 1, eval_samples,
                         blend_cache(keys, valid_weights, seed + 1, eval_samples, "valid"))
    return DataSources(tokenizer=tokenizer, train=train, valid=valid, warnings=warnings)


class StepBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of global sample positions for `steps` steps, from
    sample `start_sample` on.

    With G = micro x accum x dp, the k-th step covers positions start + [k*G, (k+1)*G); its
    micro-batch m on rank r takes start + k*G + (m*dp + r)*micro + [0, micro). The data position
    is the number of samples consumed, not the step count, so a resume with another number of
    data-parallel ranks or another global batch continues at the exact next sample.
    """

    def __init__(self, micro: int, accum: int, dp_size: int, dp_rank: int, start_sample: int,
                 steps: int):
        self.micro, self.accum, self.dp, self.rank = micro, accum, dp_size, dp_rank
        self.start, self.steps = start_sample, steps
        self.global_batch = micro * accum * dp_size

    def __iter__(self) -> Iterator[List[int]]:
        for k in range(self.steps):
            for m in range(self.accum):
                base = self.start + k * self.global_batch + (m * self.dp + self.rank) * self.micro
                yield list(range(base, base + self.micro))

    def __len__(self):
        return self.steps * self.accum


def train_loader(stream: SampleStream, batch_sizes: dict, dp_size: int, dp_rank: int,
                 start_sample: int, steps: int, num_workers: int):
    sampler = StepBatchSampler(batch_sizes["micro"], batch_sizes["accum"], dp_size, dp_rank, start_sample,
                               steps)
    return torch.utils.data.DataLoader(stream, batch_sampler=sampler, num_workers=num_workers,
                                       persistent_workers=num_workers > 0)


def check_eval_share(eval_samples: int, dp_size: int):
    """Every data-parallel rank evaluates an equal share of the held-out samples (eval_batches),
    so fewer samples than ranks would leave none: a NaN held-out loss (the plan refuses it)."""
    if eval_samples < dp_size:
        raise DrScaleError(f"train.eval_samples={eval_samples}: fewer than the {dp_size} "
                           f"data-parallel ranks, which evaluate an equal share each; expected "
                           f"at least {dp_size} (a multiple of {dp_size} uses every sample)")


def eval_batches(stream: SampleStream, micro: int, dp_size: int, dp_rank: int):
    """The same held-out samples every time, split round-robin over data-parallel ranks. Every
    rank gets as many (ZeRO-3 gathers parameters collectively in each forward)."""
    usable = len(stream) - len(stream) % dp_size
    mine = list(range(dp_rank, usable, dp_size))
    for i in range(0, len(mine), micro):
        yield torch.stack([stream[p] for p in mine[i:i + micro]])
