"""Tokenizers: sentencepiece models (`.model`) and Hugging Face `tokenizer.json` files (the
`tokenizers` library: the byte-level BPE of Llama-3, Qwen2, GPT-2 and most new models), behind
one interface; training either kind from raw text.

    load_tokenizer(path)   a .model file, a tokenizer.json file, or a folder holding either

Every tokenizer has a `path`, the `sha256` of that file (its identity, recorded beside the data
it made and checked when a run reads the data), `vocab_size`, `eod_id` (the end-of-document
token the data pipeline appends), `encode`, `encode_batch`, `decode`, and `file_name`, the name
a run folder and an exported model keep it under.
"""
import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Iterator, List

from dr_scale.errors import DrScaleError

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")
SENTENCEPIECE_FILE, HF_FILE = "tokenizer.model", "tokenizer.json"
# Hugging Face tokenizers name their end of text differently; the first present is taken when
# no tokenizer_config.json beside the file names an eos_token.
HF_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_tokenizer(path):
    """The tokenizer at `path`: a sentencepiece .model, a tokenizer.json, or a folder with one
    (the sentencepiece model first: exported folders carry both, and it is the exact one)."""
    path = Path(path).expanduser()
    if path.is_dir():
        for name in (SENTENCEPIECE_FILE, HF_FILE):
            if (path / name).is_file():
                return load_tokenizer(path / name)
        raise DrScaleError(f"{path}: a folder without {SENTENCEPIECE_FILE} or {HF_FILE}")
    if path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def tokenizer_file_in(folder):
    """The tokenizer file a run folder (or exported model) keeps, or None."""
    for name in (SENTENCEPIECE_FILE, HF_FILE):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


class SentencePieceTokenizer:
    kind, file_name = "sentencepiece", SENTENCEPIECE_FILE

    def __init__(self, model_path):
        import sentencepiece as spm

        self.path = Path(model_path).expanduser()
        if not self.path.is_file():
            raise DrScaleError(f"{self.path}: tokenizer not found (expected a sentencepiece "
                               ".model or a Hugging Face tokenizer.json; `dr-scale tokenizer` "
                               "trains either)")
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

    @property
    def eod_token(self) -> str:
        return self.sp.IdToPiece(self.eod_id)

    def encode(self, text: str) -> List[int]:
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        # one thread: preprocessing's parallelism is its worker processes
        return self.sp.Encode(texts, out_type=int, num_threads=1)

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


class HFTokenizer:
    """A `tokenizers` tokenizer.json. Text is encoded without the special tokens its
    post-processor would add (Llama-3's adds a BOS): the pipeline appends the end-of-document
    token itself, as for sentencepiece."""
    kind, file_name = "huggingface", HF_FILE

    def __init__(self, path):
        from tokenizers import Tokenizer as RustTokenizer

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise DrScaleError(f"{self.path}: tokenizer not found (expected a Hugging Face "
                               "tokenizer.json or a sentencepiece .model)")
        try:
            self.tok = RustTokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            raise DrScaleError(f"{self.path}: not a Hugging Face tokenizer.json "
                               f"({str(e).splitlines()[0][:120]})") from None
        self.sha256 = file_sha256(self.path)
        self.eod_token = self._end_token()
        self._eod_id = self.tok.token_to_id(self.eod_token)

    def _end_token(self) -> str:
        config = self.path.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except json.JSONDecodeError as e:
                raise DrScaleError(f"{config}: JSON syntax error at line {e.lineno}: "
                                   f"{e.msg}") from None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
                return eos
        for token in HF_END_TOKENS:
            if self.tok.token_to_id(token) is not None:
                return token
        raise DrScaleError(f"{self.path}: no end-of-text token (looked for a tokenizer_config.json "
                           f"eos_token beside it, then {', '.join(HF_END_TOKENS)}); needed as the "
                           f"document separator")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        # one call a text, one thread (the library's encode_batch would start a thread per core):
        # preprocessing's parallelism is its worker processes
        return [self.tok.encode(t, add_special_tokens=False).ids for t in texts]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


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
    import sentencepiece as spm

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


def train_bpe_tokenizer(texts: Iterable[str], out_prefix, vocab_size: int) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 / Llama-3 style: bytes mapped to printable
    characters, so any text round-trips and there is no unknown token) with the `tokenizers`
    library; writes ``out_prefix``.json with `<|endoftext|>` as its end-of-text token."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(f"{out_prefix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    end = HF_END_TOKENS[0]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size <= len(alphabet) + 1:
        raise DrScaleError(f"--vocab_size {vocab_size}: a byte-level BPE needs more than "
                           f"{len(alphabet) + 1} (the 256 byte symbols and {end})")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[end],
                                  initial_alphabet=alphabet, show_progress=False)
    seen = []

    def nonempty():
        for t in texts:
            if t.strip():
                seen.append(True)
                yield t
    tok.train_from_iterator(nonempty(), trainer)
    if not seen:
        raise DrScaleError(f"{out}: no text to train a tokenizer on (empty corpus)")
    tok.save(str(out))
    return out
