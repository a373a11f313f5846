"""SentencePiece BPE tokenizer: training from raw text, and the wrapper the pipeline uses."""
import hashlib
import re
from pathlib import Path
from typing import Iterable, Iterator, List

import sentencepiece as spm

from dr_scale.errors import DrScaleError

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    def __init__(self, model_path):
        self.path = Path(model_path).expanduser()
        if not self.path.is_file():
            raise DrScaleError(f"{self.path}: tokenizer model not found (expected a sentencepiece "
                               ".model file; `dr-scale tokenizer` trains one)")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            raise DrScaleError(f"{self.path}: not a sentencepiece model ({str(e).splitlines()[0]})"
                               ) from None
        self.sha256 = file_sha256(self.path)
        if self.sp.eos_id() < 0:
            raise DrScaleError(f"{self.path}: tokenizer has no end-of-sequence piece "
                               "(needed as the document separator)")

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def eod_id(self) -> int:
        return self.sp.eos_id()

    def encode(self, text: str) -> List[int]:
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        return self.sp.Encode(texts, out_type=int, num_threads=0)

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for piece in _SENTENCE_END.split(text):
            piece = piece.strip()
            if piece:
                yield piece


def train_tokenizer(texts: Iterable[str], out_prefix, vocab_size: int) -> Path:
    """Train a byte-fallback BPE model on ``texts``; writes ``out_prefix``.model/.vocab.

    No normalization and no whitespace folding (as Llama's tokenizer): decode(encode(text)) gives
    the text back, tabs and newlines included. The vocabulary holds the 256 byte pieces, so it
    must be larger than 256 + the corpus' distinct characters."""
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    sentences = list(_sentences(texts))
    if not sentences:
        raise DrScaleError(f"{out_prefix}.model: no text to train a tokenizer on (empty corpus)")
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(sentences), model_prefix=str(out_prefix),
            vocab_size=vocab_size, model_type="bpe", byte_fallback=True, split_digits=True,
            character_coverage=0.9995, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=1 << 16, num_threads=2, minloglevel=2)
    except RuntimeError as e:
        raise DrScaleError(f"{out_prefix}.model: tokenizer training failed: "
                           f"{str(e).splitlines()[0]}") from None
    return out_prefix.with_suffix(".model")
