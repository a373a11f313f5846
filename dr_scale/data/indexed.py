"""Memory-mapped indexed dataset in Megatron's .bin/.idx format (readable by Megatron tools).

.idx layout: magic b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count <Q,
document count <Q, then int32 sizes, int64 byte pointers, int64 document indices. Here every
sequence is one document. A sidecar <prefix>.meta.json records the tokenizer that made the file.
"""
import json
import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

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


class IndexedDataset:
    """Read-only view of a .bin/.idx pair; validated fully at open (sizes, pointers, lengths)."""

    def __init__(self, prefix):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path, self.meta_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise DrScaleError(f"{p}: dataset file not found (expected a .bin/.idx pair made "
                                   "by `dr-scale preprocess`)")
        self._read_index()
        self._check_bin()
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") \
            if self.bin_path.stat().st_size else np.zeros(0, dtype=self.dtype)
        self.meta = self._read_meta()

    def _read_index(self):
        raw = self.idx_path.read_bytes()
        where = self.idx_path
        if len(raw) < _HEADER.size:
            raise DrScaleError(f"{where}: truncated index ({len(raw)} bytes, header needs "
                               f"{_HEADER.size})")
        magic, version, code, n_seq, n_doc = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise DrScaleError(f"{where}: not a Megatron-format index (bad magic {magic!r})")
        if version != VERSION:
            raise DrScaleError(f"{where}: index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise DrScaleError(f"{where}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(raw) != expected:
            raise DrScaleError(f"{where}: index is {len(raw)} bytes, expected {expected} for "
                               f"{n_seq} sequences (truncated or corrupt)")
        off = _HEADER.size
        self.sizes = np.frombuffer(raw, np.int32, n_seq, off)
        self.pointers = np.frombuffer(raw, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(raw, np.int64, n_doc, off + 12 * n_seq)
        if n_seq:
            expect_ptr = np.concatenate([[0], np.cumsum(self.sizes[:-1], dtype=np.int64)])
            if (self.sizes < 0).any() or not np.array_equal(
                    self.pointers, expect_ptr * self.dtype.itemsize):
                raise DrScaleError(f"{where}: sizes and pointers disagree (corrupt index)")
        if n_doc == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq or \
                (np.diff(self.document_indices) < 0).any():
            raise DrScaleError(f"{where}: document indices are not 0..{n_seq} ascending "
                               "(corrupt index)")

    def _check_bin(self):
        expected = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        actual = self.bin_path.stat().st_size
        if actual != expected:
            raise DrScaleError(f"{self.bin_path}: {actual} bytes, the index expects {expected} "
                               "(truncated or not the matching .bin)")

    def _read_meta(self) -> dict:
        if not self.meta_path.is_file():
            return {}
        try:
            return json.loads(self.meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DrScaleError(f"{self.meta_path}: JSON syntax error at line {e.lineno}: "
                               f"{e.msg}") from None

    def check_tokenizer(self, tokenizer):
        """One-line error when the data was made with another tokenizer or a larger vocab."""
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

    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def document(self, i: int) -> np.ndarray:
        start = self.pointers[i] // self.dtype.itemsize
        return self.tokens[start:start + self.sizes[i]]
