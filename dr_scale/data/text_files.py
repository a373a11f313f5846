"""Raw text in the formats corpora ship in, read as documents, and cut into pieces that
processes can read independently.

    .jsonl / .json       one JSON object a line, the text under `text_key`
    .txt                 the whole file is one document
    .parquet             one row a document, the text in column `text_key`
    + .gz / .zst         compressed JSON lines or text (read as a stream)

A `Piece` is one unit of work: a byte range of an uncompressed JSON-lines file (cut at line
boundaries), a row group of a Parquet file, or a whole file otherwise. Pieces depend only on the
files and the piece size, never on the number of workers, so any number of workers writes the
same documents in the same order.
"""
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

from dr_scale.errors import DrScaleError

# Byte ranges of JSON lines per piece: about 1/64 of the input, within [1, 16] MiB. Many pieces
# keep workers busy to the end (with 4 pieces of 60 MiB, 2 workers measured 1.78x instead of 2x:
# one waited on the other's last piece); the bounds keep per-piece overhead and files in check.
MIN_PIECE, MAX_PIECE, PIECES_PER_INPUT = 1 << 20, 16 << 20, 64


@dataclass(frozen=True)
class Piece:
    path: str
    kind: str          # "jsonl", "text" or "parquet"
    compression: str   # "", "gz" or "zst"
    start: int = 0     # byte range (uncompressed jsonl), or the row group (parquet)
    end: int = -1      # -1: to the end
    size: int = 0      # bytes this piece accounts for in progress (compressed bytes if so)


def _kind(path: Path):
    name, compression = path.name, ""
    for ext in ("gz", "zst"):
        if name.endswith("." + ext):
            name, compression = name[:-len(ext) - 1], ext
    if name.endswith((".jsonl", ".json")):
        return "jsonl", compression
    if name.endswith(".parquet"):
        if compression:
            raise DrScaleError(f"{path}: a compressed .parquet file; Parquet compresses its own "
                               "pages, give the .parquet file itself")
        return "parquet", ""
    if name.endswith(".txt"):
        return "text", compression
    raise DrScaleError(f"{path}: unknown input format (expected .jsonl, .json, .txt or .parquet, "
                       "optionally .gz or .zst)")


def auto_piece_bytes(paths: Sequence) -> int:
    total = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    return int(min(MAX_PIECE, max(MIN_PIECE, total // PIECES_PER_INPUT)))


def plan_pieces(paths: Sequence, piece_bytes: Optional[int] = None) -> List[Piece]:
    """Every input cut into pieces (of `piece_bytes`, default auto_piece_bytes), in input
    order. The output does not depend on the cut, only resuming does (the plan is kept)."""
    piece_bytes = piece_bytes or auto_piece_bytes(paths)
    pieces = []
    for p in map(Path, paths):
        if not p.is_file():
            raise DrScaleError(f"{p}: input file not found")
        kind, compression = _kind(p)
        size = p.stat().st_size
        if kind == "parquet":
            groups = _parquet_file(p).metadata.num_row_groups
            pieces += [Piece(str(p), kind, "", g, g + 1, size // max(groups, 1))
                       for g in range(groups)]
        elif kind == "jsonl" and not compression and size > piece_bytes:
            cuts = [0]
            with open(p, "rb") as f:
                for at in range(piece_bytes, size, piece_bytes):
                    if at <= cuts[-1]:
                        continue
                    f.seek(at - 1)
                    f.readline()  # to the start of the next line (at itself if one starts there)
                    if f.tell() < size:
                        cuts.append(f.tell())
            cuts.append(size)
            pieces += [Piece(str(p), kind, "", a, b, b - a) for a, b in zip(cuts, cuts[1:])
                       if b > a]
        else:
            pieces.append(Piece(str(p), kind, compression, 0, -1, size))
    return pieces


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DrScaleError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow, or "
                           "pip install dr_scale[data])") from None
    try:
        return pq.ParquetFile(str(path))
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own kinds
        raise DrScaleError(f"{path}: not a Parquet file ({str(e).splitlines()[0][:120]})") from None


def _open_binary(path: Path, compression: str):
    if compression == "gz":
        return gzip.open(path, "rb")
    if compression == "zst":
        try:
            import zstandard
        except ImportError:
            raise DrScaleError(f"{path}: reading .zst needs zstandard (pip install zstandard, or "
                               "pip install dr_scale[data])") from None
        # buffered: the decompressing reader reads blocks but has no readline of its own
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(
            open(path, "rb"), closefd=True))
    return open(path, "rb")


def _where(piece: Piece, offset: int) -> str:
    """`path:line` of the line starting at byte `offset` (counted only for an error), or its
    byte in the decompressed stream of a compressed file."""
    if piece.compression:
        return f"{piece.path}:byte {offset} of the decompressed stream"
    with open(piece.path, "rb") as f:
        line = f.read(offset).count(b"\n") + 1
    return f"{piece.path}:{line}"


def read_piece(piece: Piece, text_key: str = "text") -> Iterator[str]:
    """The documents of one piece, in file order."""
    path = Path(piece.path)
    if piece.kind == "parquet":
        table = _parquet_file(path).read_row_group(piece.start)
        if text_key not in table.column_names:
            raise DrScaleError(f"{path}: no column '{text_key}' (columns: "
                               f"{', '.join(table.column_names)}); choose one with --text_key")
        for i, value in enumerate(table.column(text_key).to_pylist()):
            if not isinstance(value, str):
                raise DrScaleError(f"{path}: row group {piece.start}, row {i}: '{text_key}' is "
                                   f"{type(value).__name__}, expected a string")
            yield value
        return
    try:
        with _open_binary(path, piece.compression) as raw:
            if piece.kind == "text":
                yield io.TextIOWrapper(raw, encoding="utf-8", newline="").read()
                return
            if piece.start:
                raw.seek(piece.start)
            pos = piece.start
            for line in raw:
                line_start, pos = pos, pos + len(line)
                if piece.end >= 0 and line_start >= piece.end:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DrScaleError(f"{_where(piece, line_start)}: invalid JSON "
                                       f"({getattr(e, 'msg', None) or e.reason})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                    raise DrScaleError(f"{_where(piece, line_start)}: expected a JSON object "
                                       f"with a string under '{text_key}'")
                yield obj[text_key]
    except DrScaleError:
        raise
    except UnicodeDecodeError as e:
        raise DrScaleError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except Exception as e:  # noqa: BLE001 - gzip, zstandard and the OS each raise their own
        raise DrScaleError(f"{path}: unreadable ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120] if str(e) else 'no detail'})") from None


def iter_documents(paths: Sequence, text_key: str = "text") -> Iterator[str]:
    """Every document of every input, in order (for tokenizer training and small corpora)."""
    for piece in plan_pieces(paths, piece_bytes=1 << 62):
        yield from read_piece(piece, text_key)
