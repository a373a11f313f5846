"""Data made by megatron-core's IndexedDatasetBuilder (documents split into several sequences, no
.meta.json) trains here with a one-line warning and a held-out split by whole documents; data we
write opens in megatron-core with the same sequences and documents."""
import gzip
import json

import numpy as np
import pytest
import torch

from dr_scale.data.indexed import IndexedDataset
from dr_scale.data.preprocess import preprocess
from dr_scale.data.tokenizer import load_tokenizer
from tests.conftest import launch
from tests.test_train_distributed import records


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    from dr_scale.data.corpus import bundled_data

    return load_tokenizer(bundled_data(cache_dir, 4096)[0])


def chapters(n=40):
    from dr_scale.data.corpus import CORPUS

    return [json.loads(line)["text"] for line in gzip.open(CORPUS, "rt")][:n]


def megatron_made(prefix, tokenizer):
    """Each chapter one document of three sequences (as Megatron's sentence splitting makes
    them), the end-of-document token closing the last; returns the token lists per document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    documents = []
    for text in chapters():
        ids = tokenizer.encode(text) + [tokenizer.eod_id]
        cut = len(ids) // 3
        pieces = [ids[:cut], ids[cut:2 * cut], ids[2 * cut:]]
        for piece in pieces:
            builder.add_item(torch.tensor(piece))
        builder.end_document()
        documents.append(pieces)
    builder.finalize(f"{prefix}.idx")
    return documents


def test_megatron_made_data_is_read_by_document(tmp_path, tokenizer):
    from dr_scale.data.dataset import split_documents

    documents = megatron_made(tmp_path / "mg", tokenizer)
    data = IndexedDataset(tmp_path / "mg")
    assert len(data) == 3 * len(documents) and data.num_documents == len(documents)
    warning = data.check_tokenizer(tokenizer)
    assert warning.startswith(f"{tmp_path / 'mg'}: no mg.meta.json (not made by `dr-scale "
                              "preprocess`") and "cannot be checked" in warning
    assert "\n" not in warning
    train, valid = split_documents(data.num_documents, 0.1, 1234, "mg")
    held_out = set(data.sequences_of(valid).tolist())
    assert held_out == {3 * d + k for d in valid for k in range(3)}  # whole documents
    assert held_out.isdisjoint(data.sequences_of(train).tolist())
    d = int(valid[0])
    for k in range(3):
        assert data.document(3 * d + k).tolist() == documents[d][k]


def test_our_data_opens_in_megatron_core(tmp_path, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in chapters(10)))
    preprocess([src], tokenizer, tmp_path / "ours", workers=2, progress=False, piece_bytes=8192)
    ours, theirs = IndexedDataset(tmp_path / "ours"), MegatronIndexed(str(tmp_path / "ours"))
    assert len(theirs) == len(ours) == 10
    np.testing.assert_array_equal(theirs.document_indices, np.arange(11))
    for i in range(10):
        np.testing.assert_array_equal(theirs[i], ours.document(i))


def test_a_run_trains_on_megatron_made_data(tmp_path, cache_dir, tokenizer):
    megatron_made(tmp_path / "mg", tokenizer)
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero1", "--run_dir", run, f"data.tokenizer={tokenizer.path}",
                   f"data.datasets=[{{prefix: {tmp_path / 'mg'}}}]", "data.seq_length=64",
                   "train.max_steps=20", "train.eval_interval=20", "train.save_interval=20",
                   "train.eval_samples=8", "logging.plot=false", "logging.tensorboard=false"],
                  1, cache_dir)
    assert f"warning: {tmp_path / 'mg'}: no mg.meta.json" in proc.stdout
    evals = [r["eval_loss"] for r in records(run) if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0] - 1.0
