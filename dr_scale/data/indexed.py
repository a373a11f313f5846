"""Indexed dataset in Megatron's .bin/.idx format (readable by Megatron tools).

.idx layout: magic b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count <Q,
document count <Q, then int32 sizes, int64 byte pointers, int64 document indices (where each
document's sequences begin: dr_scale writes one sequence a document, Megatron's tools may split a
document into several). A sidecar <prefix>.meta.json records the tokenizer that made the file;
Megatron-made data has none.

The index and tokens are read entry by entry (data/index_cache.FileArray), never whole and
never mapped: at 1T tokens the index is gigabytes. Its full validation (sizes against pointers,
the .bin's length) reads it in chunks and runs once per file, remembered by the index cache.
"""
import json
import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

from dr_scale.data.index_cache import FileArray
from dr_scale.errors import DrScaleError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int):
    """The smallest dtype that holds every token id."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def paths(prefix):
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + ".meta.json")


class IndexedDatasetWriter:
    """Append documents, then finalize(). Files appear only at finalize (temp file + rename), so
    an interrupted run never leaves a half-written dataset under the real name."""

    def __init__(self, prefix, dtype):
        self.bin_path, self.idx_path, self.meta_path = paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + f".tmp{os.getpid()}")
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = []  # document lengths: python ints and, from add_dataset, arrays

    def add_document(self, tokens):
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)

    def add_dataset(self, prefix):
        """Append every document of another .bin/.idx of the same token dtype (a merge)."""
        import shutil

        part = IndexedDataset(prefix)
        if part.dtype != self.dtype:
            raise DrScaleError(f"{part.idx_path}: tokens are {part.dtype}, expected {self.dtype}")
        with open(part.bin_path, "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)
        self._sizes.append(np.asarray(part.sizes, dtype=np.int32))

    @property
    def sizes(self) -> np.ndarray:
        parts = [np.asarray(s, dtype=np.int32).reshape(-1) for s in self._sizes]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def abandon(self):
        """Close and delete the temporary file (nothing appears under the real names)."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)

    def finalize(self, meta: Optional[dict] = None):
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = self.sizes
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        tmp_idx = self.idx_path.with_name(self.idx_path.name + f".tmp{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF[self.dtype], len(sizes), len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)
        if meta is not None:
            tmp_meta = self.meta_path.with_name(self.meta_path.name + ".tmp")
            tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp_meta, self.meta_path)


CHECK_CHUNK = 1 << 22  # entries per read when validating


class IndexedDataset:
    """Read-only view of a .bin/.idx pair. The header and lengths are checked at open; with
    `check_contents` (default) also every size against its pointer and the .bin's length."""

    def __init__(self, prefix, check_contents: bool = True):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path, self.meta_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise DrScaleError(f"{p}: dataset file not found (expected a .bin/.idx pair made "
                                   "by `dr-scale preprocess`)")
        self._map_index()
        if check_contents:
            self.check_contents()
        self.tokens = FileArray(self.bin_path, self.dtype, 0,
                                self.bin_path.stat().st_size // self.dtype.itemsize)
        self.meta = self._read_meta()

    def _map_index(self):
        where = self.idx_path
        size = where.stat().st_size
        with open(where, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise DrScaleError(f"{where}: truncated index ({len(head)} bytes, header needs "
                               f"{_HEADER.size})")
        magic, version, code, n_seq, n_doc = _HEADER.unpack_from(head)
        if magic != MAGIC:
            raise DrScaleError(f"{where}: not a Megatron-format index (bad magic {magic!r})")
        if version != VERSION:
            raise DrScaleError(f"{where}: index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise DrScaleError(f"{where}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size != expected:
            raise DrScaleError(f"{where}: index is {size} bytes, expected {expected} for "
                               f"{n_seq} sequences (truncated or corrupt)")
        if n_doc == 0:
            raise DrScaleError(f"{where}: no document indices (corrupt index)")
        off = _HEADER.size
        self.sizes = FileArray(where, np.int32, off, n_seq)
        self.pointers = FileArray(where, np.int64, off + 4 * n_seq, n_seq)
        self.document_indices = FileArray(where, np.int64, off + 12 * n_seq, n_doc)

    def check_contents(self):
        """Every size against its pointer, document indices ascending from 0 to the sequence
        count, the .bin's length against the sizes; read in chunks (bounded memory)."""
        where, n_seq = self.idx_path, len(self.sizes)
        item = self.dtype.itemsize
        total = 0  # tokens before the chunk
        with open(where, "rb") as f:
            for lo in range(0, n_seq, CHECK_CHUNK):
                hi = min(n_seq, lo + CHECK_CHUNK)
                f.seek(_HEADER.size + 4 * lo)
                sizes = np.fromfile(f, np.int32, hi - lo).astype(np.int64)
                f.seek(_HEADER.size + 4 * n_seq + 8 * lo)
                pointers = np.fromfile(f, np.int64, hi - lo)
                starts = total + np.concatenate([[0], np.cumsum(sizes[:-1])])
                if (sizes < 0).any() or not np.array_equal(pointers, starts * item):
                    raise DrScaleError(f"{where}: sizes and pointers disagree (corrupt index)")
                total += int(sizes.sum())
            docs = self.document_indices
            f.seek(_HEADER.size + 12 * n_seq)
            previous = -1
            for lo in range(0, len(docs), CHECK_CHUNK):
                chunk = np.fromfile(f, np.int64, min(CHECK_CHUNK, len(docs) - lo))
                if (lo == 0 and chunk[0] != 0) or chunk[0] < previous or \
                        (np.diff(chunk) < 0).any():
                    raise DrScaleError(f"{where}: document indices are not 0..{n_seq} "
                                       "ascending (corrupt index)")
                previous = int(chunk[-1])
            if previous != n_seq:
                raise DrScaleError(f"{where}: document indices are not 0..{n_seq} ascending "
                                   "(corrupt index)")
        actual = self.bin_path.stat().st_size
        if actual != total * item:
            raise DrScaleError(f"{self.bin_path}: {actual} bytes, the index expects "
                               f"{total * item} (truncated or not the matching .bin)")

    def _read_meta(self) -> dict:
        if not self.meta_path.is_file():
            return {}
        try:
            return json.loads(self.meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DrScaleError(f"{self.meta_path}: JSON syntax error at line {e.lineno}: "
                               f"{e.msg}") from None

    def check_tokenizer(self, tokenizer) -> Optional[str]:
        """One-line error when the data was made with another tokenizer or a larger vocab; for
        data without a .meta.json (made by Megatron's tools, say), the warning to show."""
        if not self.meta:
            return (f"{self.prefix}: no {self.meta_path.name} (not made by `dr-scale "
                    f"preprocess`; Megatron's tools write none): the tokenizer that made it "
                    f"cannot be checked, data.tokenizer {tokenizer.path} is taken as given")
        made_with = self.meta.get("tokenizer_sha256")
        if made_with and made_with != tokenizer.sha256:
            raise DrScaleError(
                f"{self.meta_path}: dataset was made with tokenizer {made_with[:12]}..., but "
                f"data.tokenizer is {tokenizer.path} ({tokenizer.sha256[:12]}...); re-run "
                "`dr-scale preprocess` with that tokenizer")
        vocab = self.meta.get("vocab_size")
        if vocab is not None and vocab > tokenizer.vocab_size:
            raise DrScaleError(f"{self.meta_path}: vocab_size {vocab} exceeds the tokenizer's "
                               f"{tokenizer.vocab_size}")

    def __len__(self):
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def sequences_of(self, documents: np.ndarray) -> np.ndarray:
        """The sequence ids of `documents`, in the given order (each document's sequences in
        file order); the identity where every document is one sequence."""
        documents = np.asarray(documents, dtype=np.int64)
        bounds = np.asarray(self.document_indices)
        starts = bounds[documents]
        counts = bounds[documents + 1] - starts
        if len(counts) and (counts == 1).all():
            return starts
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(starts, counts) + (np.arange(int(counts.sum())) - offsets)

    def num_tokens(self) -> int:
        return int(np.asarray(self.sizes).sum(dtype=np.int64))

    def document(self, i: int) -> np.ndarray:
        return self.read(i)

    def read(self, i: int, offset: int = 0, count: Optional[int] = None) -> np.ndarray:
        """Tokens `offset` .. `offset + count` of sequence i (to its end when count is None; a
        caller that knows the sequence's length, as packing does, gives a count within it)."""
        if count is None:
            count = int(self.sizes[i]) - offset
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self.tokens.read(start, count)
