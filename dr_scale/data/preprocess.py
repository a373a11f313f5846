"""Raw text -> tokenized .bin/.idx (one document a sequence, the end-of-document token appended),
by a pool of worker processes over pieces of the inputs (data/text_files.py), resumable.

Each piece is tokenized into its own .bin/.idx under <out>.parts/ (written atomically: a piece
with an .idx is complete), and the pieces are joined in input order into <out>.bin/.idx at the
end. A killed run, started again with the same command, keeps the finished pieces and does the
rest. The pieces do not depend on the number of workers, so the output is byte-identical for any
--workers. Each worker tokenizes with one thread: the workers are the parallelism.
"""
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from dr_scale.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from dr_scale.data.text_files import Piece, plan_pieces, read_piece
from dr_scale.errors import DrScaleError

BATCH = 512  # documents per encode call
_worker_tokenizer = None


def parts_dir(out_prefix) -> Path:
    return Path(f"{out_prefix}.parts")


def _piece_prefix(work: Path, i: int) -> Path:
    return work / f"piece_{i:06d}"


def _tokenize_piece(tokenizer, piece: Piece, text_key: str, prefix: Path):
    """(documents, tokens) written to `prefix`.bin/.idx from one piece."""
    writer = IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size))
    docs = tokens = 0
    try:
        batch = []
        for text in read_piece(piece, text_key):
            if text.strip():
                batch.append(text)
            if len(batch) == BATCH:
                docs, tokens = _write(writer, tokenizer, batch, docs, tokens)
                batch = []
        if batch:
            docs, tokens = _write(writer, tokenizer, batch, docs, tokens)
    except BaseException:
        writer.abandon()
        raise
    writer.finalize()
    return docs, tokens


def _write(writer, tokenizer, batch, docs, tokens):
    for ids in tokenizer.encode_batch(batch):
        writer.add_document(ids + [tokenizer.eod_id])
        tokens += len(ids) + 1
    return docs + len(batch), tokens


def _init_worker(tokenizer_path: str, sha256: str):
    # one thread per worker: the Hugging Face library would otherwise start a pool per process
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from dr_scale.data.tokenizer import load_tokenizer

    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)
    if _worker_tokenizer.sha256 != sha256:
        raise DrScaleError(f"{tokenizer_path}: changed while preprocessing")


def _run_piece(job):
    i, piece, text_key, prefix = job
    try:
        return i, _tokenize_piece(_worker_tokenizer, piece, text_key, Path(prefix))
    except DrScaleError as e:
        return i, str(e)  # an error travels back as text: the parent stops in one line


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


class _Progress:
    """bytes done of the total, documents, tokens, tokens/s of this invocation, ETA."""

    def __init__(self, pieces, done_before, enabled):
        self.total = sum(p.size for p in pieces) or 1
        self.bytes = sum(pieces[i].size for i in done_before)
        self.start_bytes, self.docs, self.tokens, self.new_tokens = self.bytes, 0, 0, 0
        self.t0 = self.last = time.time()
        self.enabled = enabled

    def add(self, piece, docs, tokens, new: bool):
        self.bytes += piece.size if new else 0
        self.docs += docs
        self.tokens += tokens
        self.new_tokens += tokens if new else 0

    def show(self, force=False):
        now = time.time()
        if not self.enabled or (not force and now - self.last < 2):
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = (self.bytes - self.start_bytes) / elapsed
        eta = (self.total - self.bytes) / rate if rate > 0 else float("inf")
        print(f"preprocess: {100 * self.bytes / self.total:5.1f}% of "
              f"{self.total / 2**20:,.1f} MiB, {self.docs:,} documents, {self.tokens:,} tokens, "
              f"{self.new_tokens / elapsed:,.0f} tokens/s, "
              f"ETA {_fmt_time(eta) if eta != float('inf') else '?'}", file=sys.stderr, flush=True)


def _plan_file(work: Path, plan: dict):
    """Start <out>.parts/, or continue it when it was left by the same command."""
    path = work / "plan.json"
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except json.JSONDecodeError:
            earlier = None
        if earlier != plan:
            raise DrScaleError(f"{work}: left by an interrupted preprocess of other inputs, "
                               "tokenizer or --text_key; remove it to start over")
        return
    work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, path)


def preprocess(paths: Sequence, tokenizer, out_prefix, text_key: str = "text", workers: int = 1,
               progress: bool = True, piece_bytes: Optional[int] = None) -> dict:
    """Tokenize every document; returns the summary also written to <out_prefix>.meta.json."""
    if workers < 1:
        raise DrScaleError(f"--workers {workers}: expected 1 or more")
    pieces = plan_pieces(paths, piece_bytes)
    work = parts_dir(out_prefix)
    inputs = [[str(p), Path(p).stat().st_size, Path(p).stat().st_mtime_ns] for p in paths]
    _plan_file(work, {"inputs": inputs, "tokenizer_sha256": tokenizer.sha256,
                      "text_key": text_key, "pieces": [asdict(p) for p in pieces]})
    done = [i for i in range(len(pieces)) if _piece_prefix(work, i).with_suffix(".idx").is_file()]
    bar = _Progress(pieces, done, progress)
    for i in done:
        part = IndexedDataset(_piece_prefix(work, i))
        bar.add(pieces[i], len(part), part.num_tokens(), new=False)
    finished = set(done)
    jobs = [(i, pieces[i], text_key, str(_piece_prefix(work, i)))
            for i in range(len(pieces)) if i not in finished]
    if done and progress:
        print(f"preprocess: continuing {work}: {len(done)} of {len(pieces)} pieces done",
              file=sys.stderr, flush=True)
    if workers == 1:
        global _worker_tokenizer
        _worker_tokenizer = tokenizer
        results = map(_run_piece, jobs)
        _consume(results, pieces, bar)
    else:
        # spawn: the workers start clean (no tokenizer threads or file handles inherited)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_init_worker,
                      initargs=(str(tokenizer.path), tokenizer.sha256)) as pool:
            _consume(pool.imap_unordered(_run_piece, jobs), pieces, bar)
    bar.show(force=True)
    if bar.docs == 0:
        shutil.rmtree(work, ignore_errors=True)
        raise DrScaleError(f"{', '.join(map(str, paths))}: no documents (empty corpus)")
    writer = IndexedDatasetWriter(out_prefix, token_dtype(tokenizer.vocab_size))
    for i in range(len(pieces)):
        writer.add_dataset(_piece_prefix(work, i))
    meta = {"documents": bar.docs, "tokens": bar.tokens, "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": str(tokenizer.path),
            "tokenizer_kind": tokenizer.kind, "tokenizer_sha256": tokenizer.sha256,
            "sources": [str(p) for p in paths], "text_key": text_key}
    writer.finalize(meta)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _consume(results, pieces, bar):
    for i, outcome in results:
        if isinstance(outcome, str):
            raise DrScaleError(outcome)
        bar.add(pieces[i], *outcome, new=True)
        bar.show()
