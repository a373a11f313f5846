"""Packed fixed-length samples, document-level train/held-out split, and the blended sample
stream that every rank indexes by global sample position."""
from typing import List, Sequence

import numpy as np
import torch

from dr_scale.errors import DrScaleError
from dr_scale.registry import DATASET_REGISTRY


def split_documents(num_docs: int, valid_fraction: float, seed: int, name: str):
    """(train doc ids, held-out doc ids), a seeded split by whole documents."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(num_docs)
    n_valid = int(np.ceil(num_docs * valid_fraction)) if valid_fraction > 0 else 0
    if n_valid and n_valid >= num_docs:
        raise DrScaleError(f"{name}: {num_docs} document(s) cannot be split into train and "
                           f"held-out parts (data.valid_fraction={valid_fraction})")
    return np.sort(order[n_valid:]), np.sort(order[:n_valid])


@DATASET_REGISTRY.register("packed")
class PackedSequenceDataset(torch.utils.data.Dataset):
    """Documents (in a seeded order) laid end to end and cut into samples of seq_length + 1 tokens
    (inputs and shifted labels); consecutive samples share one boundary token."""

    def __init__(self, indexed, doc_ids: np.ndarray, seq_length: int, seed: int, name: str):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        rng = np.random.default_rng([seed, 0xD0C])
        self.doc_ids = np.asarray(doc_ids)[rng.permutation(len(doc_ids))]
        sizes = indexed.sizes[self.doc_ids].astype(np.int64)
        self.cum = np.concatenate([[0], np.cumsum(sizes)])
        self.num_samples = max(0, int(self.cum[-1] - 1) // seq_length)
        if self.num_samples == 0:
            raise DrScaleError(f"{name}: {int(self.cum[-1])} tokens, fewer than one sample of "
                               f"data.seq_length + 1 = {seq_length + 1}")

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_length
        end = start + self.seq_length + 1
        d = int(np.searchsorted(self.cum, start, side="right")) - 1
        parts, pos = [], start
        while pos < end:
            doc = self.indexed.document(int(self.doc_ids[d]))
            lo = pos - int(self.cum[d])
            take = doc[lo:lo + (end - pos)]
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
    position), so a run resumes exactly from the number of samples it consumed."""

    def __init__(self, datasets: List[PackedSequenceDataset], weights: Sequence[float],
                 seed: int, length: int):
        self.datasets, self.weights, self.seed, self.length = datasets, list(weights), seed, length
        self.owner = blend_schedule(weights, length)
        self.local = np.zeros(length, dtype=np.int64)  # k-th pick of its dataset
        for j in range(len(datasets)):
            mask = self.owner == j
            self.local[mask] = np.arange(int(mask.sum()))
        self._perms = {}

    def __len__(self):
        return self.length

    def _perm(self, j: int, epoch: int) -> np.ndarray:
        key = (j, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            n = len(self.datasets[j])
            self._perms[key] = np.random.default_rng([self.seed, j, epoch]).permutation(n)
        return self._perms[key]

    def __getitem__(self, position: int):
        j, k = int(self.owner[position]), int(self.local[position])
        n = len(self.datasets[j])
        sample = self.datasets[j][self._perm(j, k // n)[k % n]]
        return torch.from_numpy(sample)
