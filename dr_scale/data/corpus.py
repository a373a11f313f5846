"""The bundled corpus and the cached tokenizer + dataset built from it on first use."""
import hashlib
import os
import shutil
import time
from pathlib import Path

from dr_scale.data.preprocess import preprocess
from dr_scale.data.text_files import iter_documents
from dr_scale.data.tokenizer import SENTENCEPIECE_FILE, load_tokenizer, train_tokenizer
from dr_scale.runtime import file_lock

CORPUS = Path(__file__).resolve().parent / "corpus" / "kjv_selection.jsonl.gz"
_BUILD_VERSION = "2"  # bump when the build below changes what it writes


def _key(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def bundled_folder(cache_dir, vocab_size: int, given=None) -> Path:
    """Where the bundled corpus is (or will be) built for these settings; `given`: a loaded
    tokenizer to tokenize it with, None: one trained on it."""
    key = _key(_BUILD_VERSION, CORPUS.read_bytes(), vocab_size, given and given.sha256)
    return Path(os.path.expanduser(cache_dir)) / f"bundled-{key}"


def bundled_data(cache_dir, vocab_size: int, tokenizer=None):
    """(tokenizer file, dataset prefix) for the bundled corpus, built once and cached: with a
    sentencepiece tokenizer trained on it, or tokenized with `tokenizer` (either kind: its file,
    or the tokenizer loaded).

    Built once under a file lock (ranks on several nodes sharing the cache folder wait for the
    first), in a private temporary folder renamed into place, so no reader sees a half-written
    cache.
    """
    cache_dir = Path(os.path.expanduser(cache_dir))
    given = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    final = bundled_folder(cache_dir, vocab_size, given)
    key = final.name[len("bundled-"):]
    tokenizer_name = given.file_name if given else SENTENCEPIECE_FILE
    if not (final / "DONE").exists():
        with file_lock.exclusive(cache_dir / f".bundled-{key}.lock",
                                 "waiting for another process building the bundled corpus"):
            if not (final / "DONE").exists():  # nobody built it while this process waited
                _build(final, cache_dir / f".bundled-{key}.tmp{os.getpid()}", given,
                       tokenizer_name, vocab_size)
    return final / tokenizer_name, final / "corpus"


def _build(final: Path, tmp: Path, given, tokenizer_name: str, vocab_size: int):
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    if given is None:
        model = train_tokenizer(iter_documents([CORPUS]), tmp / "tokenizer", vocab_size)
    else:
        model = tmp / tokenizer_name
        shutil.copyfile(given.path, model)
    preprocess([CORPUS], load_tokenizer(model), tmp / "corpus", progress=False)
    (tmp / "DONE").write_text(f"built in {time.time() - t0:.1f}s\n")
    os.rename(tmp, final)
