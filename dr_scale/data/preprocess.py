"""Raw text / JSONL -> tokenized .bin/.idx (one document a sequence, EOD appended)."""
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

from dr_scale.data.indexed import IndexedDatasetWriter, token_dtype
from dr_scale.errors import DrScaleError


def _open_text(path: Path):
    if not path.is_file():
        raise DrScaleError(f"{path}: input file not found")
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else \
        open(path, encoding="utf-8")


def iter_documents(paths: Sequence, json_key: str = "text") -> Iterator[str]:
    """Documents from .jsonl[.gz] (one JSON object a line, text under ``json_key``) or .txt[.gz]
    (each file one document)."""
    for p in map(Path, paths):
        name = p.name[:-3] if p.name.endswith(".gz") else p.name
        with _open_text(p) as f:
            try:
                if name.endswith((".jsonl", ".json")):
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DrScaleError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
                        if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
                            raise DrScaleError(f"{p}:{lineno}: expected a JSON object with a "
                                               f"string under '{json_key}'")
                        yield obj[json_key]
                else:
                    yield f.read()
            except UnicodeDecodeError as e:
                raise DrScaleError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _batched(it: Iterable[str], n: int) -> Iterator[List[str]]:
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(paths: Sequence, tokenizer, out_prefix, json_key: str = "text",
               progress: bool = True) -> dict:
    """Tokenize every document; returns the summary also written to <out_prefix>.meta.json."""
    writer = IndexedDatasetWriter(out_prefix, token_dtype(tokenizer.vocab_size))
    docs = tokens = 0
    t0 = last = time.time()
    for batch in _batched((d for d in iter_documents(paths, json_key) if d.strip()), 512):
        for ids in tokenizer.encode_batch(batch):
            writer.add_document(ids + [tokenizer.eod_id])
            docs += 1
            tokens += len(ids) + 1
        if progress and time.time() - last > 2:
            last = time.time()
            print(f"preprocess: {docs:,} documents, {tokens:,} tokens, "
                  f"{tokens / (last - t0):,.0f} tokens/s", file=sys.stderr, flush=True)
    if docs == 0:
        writer._bin.close()
        writer._tmp_bin.unlink(missing_ok=True)
        raise DrScaleError(f"{', '.join(map(str, paths))}: no documents (empty corpus)")
    meta = {"documents": docs, "tokens": tokens, "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": str(tokenizer.path),
            "tokenizer_sha256": tokenizer.sha256, "sources": [str(p) for p in paths]}
    writer.finalize(meta)
    return meta
