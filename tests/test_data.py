"""Data: sentencepiece, .bin/.idx round trip and corruption, packing, split, blending, sampler."""
import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dr_scale.data.dataset import PackedSequenceDataset, SampleStream, blend_schedule, split_documents
from dr_scale.data.index_cache import content_identity
from dr_scale.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from dr_scale.data.loader import StepBatchSampler
from dr_scale.data.preprocess import preprocess
from dr_scale.data.tokenizer import load_tokenizer, train_tokenizer
from dr_scale.errors import DrScaleError

TEXT = ["In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void; and darkness was upon the face of the deep.",
        "And God said, Let there be light: and there was light. 1234 apples!"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from dr_scale.data.corpus import CORPUS
    from dr_scale.data.text_files import iter_documents

    out = tmp_path_factory.mktemp("tok") / "tok"
    return load_tokenizer(train_tokenizer(iter_documents([CORPUS]), out, 1000))


def test_tokenizer_round_trip_is_lossless(tokenizer):
    assert tokenizer.vocab_size == 1000
    for text in TEXT[:3] + ["Unseen glyphs: ü ß 漢字 🙂 — tab\tend"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text  # byte fallback: nothing lost
    # BPE merges whole words of the corpus: far fewer pieces than characters.
    assert len(tokenizer.encode(TEXT[0])) < len(TEXT[0]) / 3


def test_tokenizer_bad_files(tmp_path):
    with pytest.raises(DrScaleError, match=r"missing\.model: tokenizer not found"):
        load_tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DrScaleError, match=r"bad\.model: not a sentencepiece model"):
        load_tokenizer(bad)


def test_empty_corpus_is_one_line_error(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DrScaleError, match=r"empty\.jsonl: no documents \(empty corpus\)"):
        preprocess([empty], tokenizer, tmp_path / "out", progress=False)
    assert not list(tmp_path.glob("out*"))  # nothing half-written left behind
    with pytest.raises(DrScaleError, match="empty corpus"):
        train_tokenizer(iter(["", "  "]), tmp_path / "t", 100)


def test_bad_jsonl_line_is_named(tmp_path, tokenizer):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    with pytest.raises(DrScaleError, match=r"a\.jsonl:2: expected a JSON object with a string under 'text'"):
        preprocess([f], tokenizer, tmp_path / "out", progress=False)


def test_preprocess_round_trip(tmp_path, tokenizer):
    src = tmp_path / "docs.jsonl.gz"
    with gzip.open(src, "wt") as f:
        for t in TEXT:
            f.write(json.dumps({"text": t}) + "\n")
    txt = tmp_path / "one.txt"
    txt.write_text("A whole file is one document.\nSecond line.")
    meta = preprocess([src, txt], tokenizer, tmp_path / "corpus", progress=False)
    ds = IndexedDataset(tmp_path / "corpus")
    assert len(ds) == meta["documents"] == len(TEXT) + 1
    assert ds.dtype == np.uint16
    for i, t in enumerate(TEXT[:5]):
        doc = ds.document(i)
        assert doc[-1] == tokenizer.eod_id
        assert tokenizer.decode(doc[:-1]) == t
    assert tokenizer.decode(ds.document(len(TEXT))[:-1]) == txt.read_text()
    ds.check_tokenizer(tokenizer)


def test_dataset_made_with_another_tokenizer_is_refused(tmp_path, tokenizer):
    other = load_tokenizer(train_tokenizer(iter(TEXT * 5), tmp_path / "other", 400))
    preprocess([_jsonl(tmp_path, TEXT)], other, tmp_path / "c", progress=False)
    with pytest.raises(DrScaleError, match=r"c\.meta\.json: dataset was made with tokenizer .* re-run `dr-scale preprocess`"):
        IndexedDataset(tmp_path / "c").check_tokenizer(tokenizer)


def _jsonl(tmp_path, texts):
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return f


docs_strategy = st.lists(st.lists(st.integers(0, 65535), max_size=50), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, big_vocab=st.booleans())
def test_bin_idx_round_trip_is_exact(tmp_path_factory, docs, big_vocab):
    prefix = tmp_path_factory.mktemp("rt") / "d"
    dtype = token_dtype(200_000 if big_vocab else 65_536)
    w = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        w.add_document(d)
    w.finalize()
    ds = IndexedDataset(prefix)
    assert [ds.document(i).tolist() for i in range(len(ds))] == docs
    # Writing what was read gives byte-identical files.
    w2 = IndexedDatasetWriter(prefix.with_name("again"), dtype)
    for i in range(len(ds)):
        w2.add_document(ds.document(i))
    w2.finalize()
    for ext in (".bin", ".idx"):
        assert (prefix.parent / f"d{ext}").read_bytes() == (prefix.parent / f"again{ext}").read_bytes()


def _make(tmp_path, docs=([1, 2, 3], [4, 5], [6, 7, 8, 9])):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return tmp_path / "d"


@pytest.mark.parametrize("damage, pattern", [
    (lambda b, i: b.write_bytes(b.read_bytes()[:-2]), r"d\.bin: 16 bytes, the index expects 18 \(truncated"),
    (lambda b, i: i.write_bytes(i.read_bytes()[:-5]), r"d\.idx: index is \d+ bytes, expected \d+ .*truncated"),
    (lambda b, i: i.write_bytes(b"XXXXXXXXX" + i.read_bytes()[9:]), r"d\.idx: not a Megatron-format index"),
    (lambda b, i: i.write_bytes(i.read_bytes()[:10]), r"d\.idx: truncated index"),
    (lambda b, i: b.unlink(), r"d\.bin: dataset file not found"),
    (lambda b, i: i.write_bytes(i.read_bytes()[:38] + b"\x07" + i.read_bytes()[39:]), r"sizes and pointers disagree"),
])
def test_corrupt_files_give_one_line_errors(tmp_path, damage, pattern):
    prefix = _make(tmp_path)
    damage(tmp_path / "d.bin", tmp_path / "d.idx")
    with pytest.raises(DrScaleError, match=pattern) as e:
        IndexedDataset(prefix)
    assert "\n" not in str(e.value)


def test_packing_covers_the_token_stream_exactly(tmp_path):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 1000, rng.integers(1, 40))) for _ in range(50)]
    ds = IndexedDataset(_make(tmp_path, docs))
    ids = np.arange(len(docs))
    packed = PackedSequenceDataset(ds, ids, seq_length=16, seed=3, name="t")
    stream = np.concatenate([ds.document(i) for i in packed.sequence_order])
    assert len(packed) == (len(stream) - 1) // 16
    for i in range(len(packed)):
        np.testing.assert_array_equal(packed[i], stream[i * 16:i * 16 + 17])
    # The document order depends on the seed, and only on it.
    other = PackedSequenceDataset(ds, ids, 16, seed=4, name="t")
    assert list(other.sequence_order) != list(packed.sequence_order)
    assert list(PackedSequenceDataset(ds, ids, 16, seed=3, name="t").sequence_order) == list(packed.sequence_order)


def test_too_short_split_is_named(tmp_path):
    ds = IndexedDataset(_make(tmp_path))
    with pytest.raises(DrScaleError, match=r"held: 9 tokens, fewer than one sample of data\.seq_length \+ 1 = 17"):
        PackedSequenceDataset(ds, np.arange(3), 16, 0, "held")


def test_split_is_disjoint_and_seeded():
    train, valid = split_documents(100, 0.05, seed=1, name="x")
    assert len(valid) == 5 and len(train) == 95
    assert set(train).isdisjoint(valid) and set(train) | set(valid) == set(range(100))
    assert list(split_documents(100, 0.05, seed=1, name="x")[1]) == list(valid)
    with pytest.raises(DrScaleError, match="cannot be split"):
        split_documents(1, 0.5, seed=1, name="x")


@settings(max_examples=50, deadline=None)
@given(weights=st.lists(st.floats(0.05, 10), min_size=1, max_size=4), n=st.integers(1, 500))
def test_blend_follows_weights_in_every_prefix(weights, n):
    owner = blend_schedule(weights, n)
    w = np.asarray(weights) / sum(weights)
    for prefix in {n // 3, n // 2, n}:
        counts = np.bincount(owner[:prefix], minlength=len(w))
        assert np.all(np.abs(counts - w * prefix) <= (1 + len(w)) / 2 + 1e-9)


def test_sample_stream_epochs_visit_every_sample_once(tmp_path):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 1000, 30)) for _ in range(20)]
    ds = IndexedDataset(_make(tmp_path, docs))
    packed = PackedSequenceDataset(ds, np.arange(20), 10, 0, "t")
    n = len(packed)
    stream = SampleStream([packed], [1.0], seed=5, length=3 * n)
    epochs = [[tuple(stream[p].tolist()) for p in range(e * n, (e + 1) * n)] for e in range(3)]
    every = sorted(tuple(packed[i].tolist()) for i in range(n))
    for e in epochs:
        assert sorted(e) == every
    assert epochs[0] != epochs[1]  # reshuffled per epoch


def test_step_sampler_partitions_global_batches_and_resumes():
    micro, accum, dp = 2, 3, 2
    per_rank = [list(StepBatchSampler(micro, accum, dp, r, 0, 4)) for r in range(dp)]
    seen = sorted(p for batches in per_rank for b in batches for p in b)
    assert seen == list(range(4 * micro * accum * dp))  # every position once, none twice
    resumed = list(StepBatchSampler(micro, accum, dp, 1, 2 * micro * accum * dp, 2))
    assert resumed == per_rank[1][2 * accum:]


def test_sampler_continues_at_the_next_sample_across_layout_changes():
    """1 rank (global batch 2) for 2 steps, then 2 ranks (global batch 4) for 2 steps, then 1 rank
    with accumulation 3 (global batch 6) for 2 steps, each leg starting at the samples consumed:
    every position read once, in order of steps, none skipped."""
    legs = [(1, 1, 2), (2, 1, 2), (1, 3, 2)]  # (data-parallel ranks, accumulation, steps)
    consumed, read = 0, []
    for dp, accum, steps in legs:
        for r in range(dp):
            read += [p for b in StepBatchSampler(2, accum, dp, r, consumed, steps) for p in b]
        consumed += 2 * accum * dp * steps
    assert consumed == 4 + 8 + 12 and sorted(read) == list(range(consumed))


def test_dataset_type_picks_the_registered_builder(tmp_path, tokenizer):
    """`data.datasets[].type` builds each dataset with the class registered under that name (here
    one made in the test: packed samples, reversed); an unknown type is one line, before any
    file is read."""
    from dr_scale.config import load_config
    from dr_scale.data.loader import build_sources, resolve_files
    from dr_scale.registry import DATASET_REGISTRY

    @DATASET_REGISTRY.register("reversed_for_test")
    class Reversed(PackedSequenceDataset):
        def __getitem__(self, i):
            return super().__getitem__(i)[::-1].copy()

    preprocess([_jsonl(tmp_path, TEXT)], tokenizer, tmp_path / "c", progress=False)

    def sources(kind):
        cfg = load_config(None, [f"data.tokenizer={tokenizer.path}", "data.seq_length=16",
                                 f"data.datasets=[{{prefix: {tmp_path / 'c'}, type: {kind}}}]"])
        tok, specs = resolve_files(cfg.data)
        return build_sources(cfg.data, 0, 8, 4, tok, specs)

    try:
        packed, reversed_ = sources("packed"), sources("reversed_for_test")
        for i in range(8):
            np.testing.assert_array_equal(np.asarray(reversed_.train[i]),
                                          np.asarray(packed.train[i])[::-1])
        assert not np.array_equal(np.asarray(reversed_.train[0]), np.asarray(packed.train[0]))
        with pytest.raises(DrScaleError, match=r"^data\.datasets\[0\]\.type: unknown dataset 'pakced'; "
                                               r"known: packed, reversed_for_test$"):
            sources("pakced")
    finally:
        DATASET_REGISTRY._items.pop("reversed_for_test")  # the test's own type only


BUILD_SOURCES = """
import os, sys, time
from dr_scale.config import load_config
from dr_scale.data.loader import build_sources, resolve_files
prefix, tokenizer, cache, start = sys.argv[1:5]
cfg = load_config(None, [f"data.tokenizer={tokenizer}", "data.seq_length=16",
                         f"data.datasets=[{{prefix: {prefix}}}]", f"data.cache_dir={cache}"])
while not os.path.exists(start):  # the processes start building at once
    time.sleep(0.01)
tok, specs = resolve_files(cfg.data)
src = build_sources(cfg.data, 7, 40, 4, tok, specs)
print([int(src.train[p].sum()) for p in range(40)])
"""


def test_index_cache_is_built_once_by_concurrent_ranks_and_found_by_content(tmp_path, tokenizer):
    """Three processes start building one dataset's sample index at once: each array is built
    by exactly one of them (the others wait on the folder's file lock, then read it), beside the
    data and keyed by what it depends on; all three read the samples an in-memory build gives.
    A copy of the dataset and its .index folder elsewhere (staged to local disk: another path and
    time) finds the arrays by content and builds nothing; a change in the data does rebuild."""
    import shutil
    import subprocess
    import sys

    preprocess([_jsonl(tmp_path, TEXT)], tokenizer, tmp_path / "c", progress=False)
    data = IndexedDataset(tmp_path / "c")
    train_ids, _ = split_documents(data.num_documents, 0.05, 7, "c")
    in_memory = SampleStream([PackedSequenceDataset(data, train_ids, 16, 7, "c")], [1.0], 7, 40)
    want = str([int(np.asarray(in_memory[p]).sum()) for p in range(40)])

    def build(prefix, processes, expected=want):
        start = tmp_path / f"start-{prefix.name}-{processes}"
        procs = [subprocess.Popen([sys.executable, "-c", BUILD_SOURCES, str(prefix),
                                   str(tokenizer.path), str(tmp_path / "cache"), str(start)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(processes)]
        start.write_text("")
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        assert expected is None or all(out.strip().splitlines()[-1] == expected
                                       for out, _ in outs)
        return [line for _, err in outs for line in err.splitlines() if " entries built in " in line]

    built = build(tmp_path / "c", 3)
    arrays = sorted((tmp_path / "c.index").rglob("*.npy"))
    assert len(arrays) >= 8 and len(list((tmp_path / "c.index").iterdir())) == 1
    names = [line.split(": ")[1] for line in built]  # "index <folder>/<array>"
    assert len(names) == len(set(names))  # each array once, by one of the three processes
    assert len([n for n in names if "index blend-" not in n]) == len(arrays)
    stamps = {p: p.stat().st_mtime_ns for p in arrays}

    staged = tmp_path / "staged"
    staged.mkdir()
    for name in ("c.bin", "c.idx", "c.index"):
        (shutil.copytree if name.endswith("index") else shutil.copy)(tmp_path / name,
                                                                     staged / name)
    assert [line for line in build(staged / "c", 2) if "index blend-" not in line] == []
    assert {p: p.stat().st_mtime_ns for p in arrays} == stamps  # nothing rebuilt either

    changed = bytearray((staged / "c.bin").read_bytes())
    changed[-1] ^= 1  # a token of the last document: the same size, other content
    (staged / "c.bin").write_bytes(bytes(changed))
    assert content_identity(staged / "c.bin") != content_identity(tmp_path / "c.bin")
    rebuilt = [line for line in build(staged / "c", 1, expected=None) if "index blend-" not in line]
    assert len(rebuilt) == len(arrays) and len(list((staged / "c.index").iterdir())) == 2
