"""Packed fixed-length samples, document-level train/held-out split, and the blended sample
stream that every rank indexes by global sample position. The arrays behind them come from an
IndexCache (data/index_cache.py): built once, read entry by entry by every rank."""
import functools
from typing import List, Sequence

import numpy as np
import torch

from dr_scale.data.index_cache import IndexCache, smallest_int
from dr_scale.errors import DrScaleError
from dr_scale.registry import DATASET_REGISTRY

IN_MEMORY = IndexCache(None)


def split_documents(num_docs: int, valid_fraction: float, seed: int, name: str,
                    cache: IndexCache = IN_MEMORY):
    """(train doc ids, held-out doc ids), a seeded split by whole documents."""
    n_valid = int(np.ceil(num_docs * valid_fraction)) if valid_fraction > 0 else 0
    if n_valid and n_valid >= num_docs:
        raise DrScaleError(f"{name}: {num_docs} document(s) cannot be split into train and "
                           f"held-out parts (data.valid_fraction={valid_fraction})")
    @functools.cache  # one permutation for both parts, and none when both are cached
    def order():
        return np.random.default_rng([seed, 0x5EED]).permutation(num_docs).astype(
            smallest_int(num_docs))
    return cache.get("train_documents", lambda: np.sort(order()[n_valid:])), \
        cache.get("valid_documents", lambda: np.sort(order()[:n_valid]))


@DATASET_REGISTRY.register("packed")
class PackedSequenceDataset(torch.utils.data.Dataset):
    """Documents (in a seeded order) laid end to end and cut into samples of seq_length + 1 tokens
    (inputs and shifted labels); consecutive samples share one boundary token. A document that
    the file splits into several sequences (Megatron's tools may) keeps them together, in order.

    `cache` holds the sequence order and cumulative token counts (arrays as long as the split)."""

    def __init__(self, indexed, doc_ids: np.ndarray, seq_length: int, seed: int, name: str,
                 cache: IndexCache = IN_MEMORY):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name

        def order():
            rng = np.random.default_rng([seed, 0xD0C])
            docs = np.asarray(doc_ids)[rng.permutation(len(doc_ids))]
            return indexed.sequences_of(docs).astype(smallest_int(len(indexed)))
        self.sequence_order = cache.get("order", order)

        def cumulative():
            sizes = np.asarray(indexed.sizes)[np.asarray(self.sequence_order)].astype(np.int64)
            return np.concatenate([[0], np.cumsum(sizes)])
        self.cum = cache.get("cumulative_tokens", cumulative)
        self.num_samples = max(0, int(self.cum[-1] - 1) // seq_length)

        def first_sequences():  # where each sample starts: a lookup, not a search, when read
            starts = np.arange(self.num_samples, dtype=np.int64) * seq_length
            found = np.searchsorted(np.asarray(self.cum), starts, side="right") - 1
            return found.astype(smallest_int(len(self.sequence_order)))
        self.first_sequence = cache.get("first_sequence", first_sequences)
        if self.num_samples == 0:
            raise DrScaleError(f"{name}: {int(self.cum[-1])} tokens, fewer than one sample of "
                               f"data.seq_length + 1 = {seq_length + 1}")

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_length
        end = start + self.seq_length + 1
        d = int(self.first_sequence[i])
        parts, pos = [], start
        while pos < end:
            first, after = (int(c) for c in self.cum[d:d + 2])  # the sequence's token range
            take = self.indexed.read(int(self.sequence_order[d]), pos - first,
                                     min(end, after) - pos)
            parts.append(take)
            pos += len(take)
            d += 1
        return np.concatenate(parts).astype(np.int64)


def blend_schedule(weights: Sequence[float], n: int) -> np.ndarray:
    """Which dataset serves each of the first n samples: dataset j's k-th sample is placed at time
    (k + 0.5) / w_j and samples are taken in time order, so in every prefix of length n each
    dataset's count is within (1 + number of datasets) / 2 of w_j * n. Vectorized, unlike
    Megatron's greedy loop, because n is the whole run's sample count."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, owners = [], []
    for j, wj in enumerate(w):
        if wj <= 0:
            continue
        k = np.arange(int(np.ceil(n * wj)) + 1)
        times.append((k + 0.5) / wj)
        owners.append(np.full(len(k), j, dtype=np.int32))
    times, owners = np.concatenate(times), np.concatenate(owners)
    return owners[np.argsort(times, kind="stable")[:n]]


class SampleStream(torch.utils.data.Dataset):
    """Global sample position -> sample. Each dataset is read in a fresh seeded permutation per
    epoch; with several datasets, positions are interleaved by weight. Deterministic in (seed,
    position), so a run resumes exactly from the number of samples it consumed.

    `cache` holds which dataset serves each position, its pick number there, and every epoch's
    permutation the run reaches (all built at construction, once: data/index_cache.py)."""

    def __init__(self, datasets: List[PackedSequenceDataset], weights: Sequence[float],
                 seed: int, length: int, cache: IndexCache = IN_MEMORY):
        self.datasets, self.weights, self.seed, self.length = datasets, list(weights), seed, length
        owner_dtype = np.int8 if len(datasets) < 128 else np.int32
        self.owner = cache.get("owner", lambda: blend_schedule(weights, length).astype(owner_dtype))

        def local():  # k-th pick of its dataset
            owner = np.asarray(self.owner)
            out = np.zeros(length, dtype=smallest_int(length))
            for j in range(len(datasets)):
                mask = owner == j
                out[mask] = np.arange(int(mask.sum()))
            return out
        self.local = cache.get("local", local)
        self._cache, self._perms = cache, {}
        picks = cache.get("picks", lambda: np.bincount(np.asarray(self.owner).astype(np.int64),
                                                       minlength=len(datasets)))
        for j, count in enumerate(np.asarray(picks)):
            for epoch in range(-(-int(count) // len(datasets[j]))):
                self._perm(j, epoch)

    def __len__(self):
        return self.length

    def _perm(self, j: int, epoch: int) -> np.ndarray:
        key = (j, epoch)
        if key not in self._perms:
            n = len(self.datasets[j])
            make = lambda: np.random.default_rng([self.seed, j, epoch]).permutation(n).astype(  # noqa: E731
                smallest_int(n))
            self._perms[key] = self._cache.get(f"permutation_{j}_{epoch}", make)
        return self._perms[key]

    def __getitem__(self, position: int):
        j, k = int(self.owner[position]), int(self.local[position])
        n = len(self.datasets[j])
        sample = self.datasets[j][self._perm(j, k // n)[k % n]]
        return torch.from_numpy(sample)
