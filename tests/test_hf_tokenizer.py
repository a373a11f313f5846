"""Hugging Face tokenizer.json wherever a sentencepiece model works: training (`dr-scale tokenizer
--type bpe`), preprocessing, the identity check either way, a run, export (transformers loads the
folder and encodes as we do) and model.init_from of that folder."""
import json
import subprocess
import sys

import pytest

from dr_scale.data.indexed import IndexedDataset
from dr_scale.data.preprocess import preprocess
from dr_scale.data.tokenizer import HFTokenizer, load_tokenizer
from dr_scale.errors import DrScaleError
from tests.conftest import ROOT, launch

TEXTS = ["In the beginning God created the heaven and the earth.",
         "Unseen glyphs: ü ß 漢字 🙂 — tab\tend\nnew line  two spaces"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dr_scale.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained by the command line on the bundled corpus."""
    from dr_scale.data.corpus import CORPUS

    out = tmp_path_factory.mktemp("bpe") / "tok"
    proc = cli("tokenizer", "--type", "bpe", "--input", CORPUS, "--out", out, "--vocab_size", 2000)
    assert proc.returncode == 0, proc.stderr
    assert "huggingface, vocab 2000, end-of-document '<|endoftext|>' id 0" in proc.stdout
    return out.with_suffix(".json")


def test_bpe_round_trip_is_lossless(bpe):
    tok = load_tokenizer(bpe)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 2000 and tok.eod_id == 0
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text  # byte-level: nothing lost
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0]) / 3  # merges whole words of the corpus
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_folder_and_end_token_from_tokenizer_config(bpe, tmp_path):
    """A folder holding tokenizer.json loads; tokenizer_config.json's eos_token names the end."""
    folder = tmp_path / "hf_tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe.read_bytes())
    assert load_tokenizer(folder).eod_token == "<|endoftext|>"
    vocab = json.loads(bpe.read_text())["model"]["vocab"]
    word = next(k for k, v in vocab.items() if v == 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": word}))
    assert load_tokenizer(folder).eod_id == 300


def test_bad_tokenizer_json_is_one_line(tmp_path, bpe):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DrScaleError, match=r"bad\.json: not a Hugging Face tokenizer\.json"):
        load_tokenizer(bad)
    spec = json.loads(bpe.read_text())
    spec["added_tokens"] = []
    spec["model"]["vocab"].pop("<|endoftext|>")
    no_end = tmp_path / "noend" / "tokenizer.json"
    no_end.parent.mkdir()
    no_end.write_text(json.dumps(spec))
    with pytest.raises(DrScaleError, match=r"no end-of-text token \(looked for a "
                                           r"tokenizer_config\.json eos_token beside it"):
        load_tokenizer(no_end)
    with pytest.raises(DrScaleError, match="a folder without tokenizer.model or tokenizer.json"):
        load_tokenizer(tmp_path / "noend" / "..")  # a folder with neither (only noend/ in it)


def test_identity_is_checked_either_way(bpe, tmp_path, cache_dir):
    from dr_scale.data.corpus import bundled_data

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    sp = load_tokenizer(bundled_data(cache_dir, 4096)[0])
    hf = load_tokenizer(bpe)
    for made_with, read_with, name in ((hf, sp, "hf"), (sp, hf, "sp")):
        meta = preprocess([src], made_with, tmp_path / name, progress=False)
        assert meta["tokenizer_sha256"] == made_with.sha256
        data = IndexedDataset(tmp_path / name)
        data.check_tokenizer(made_with)
        with pytest.raises(DrScaleError, match="dataset was made with tokenizer"):
            data.check_tokenizer(read_with)
        assert made_with.decode(data.document(0)[:-1]) == TEXTS[0]
        assert int(data.document(0)[-1]) == made_with.eod_id


def test_run_export_and_init_from_with_a_tokenizer_json(bpe, tmp_path, cache_dir):
    """Preprocess with the BPE tokenizer, train 4 steps on it, export: transformers loads the
    folder and its tokenizer encodes as ours; model.init_from of that folder takes its
    tokenizer.json as data.tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from dr_scale.config import load_config
    from dr_scale.data.corpus import CORPUS
    from dr_scale.export.hf import apply_init_from

    proc = cli("preprocess", "--input", CORPUS, "--tokenizer", bpe, "--out", tmp_path / "corpus")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    launch(["--ds_config", "zero1", "--run_dir", run, f"data.tokenizer={bpe}",
            f"data.datasets=[{{prefix: {tmp_path / 'corpus'}}}]", "data.seq_length=64",
            "train.max_steps=4", "train.eval_interval=4", "train.save_interval=4",
            "train.eval_samples=4", "logging.plot=false", "logging.tensorboard=false"], 1,
           cache_dir)
    assert (run / "tokenizer.json").read_bytes() == bpe.read_bytes()
    out = tmp_path / "hf"
    proc = cli("export", "--run_dir", run, "--out", out)
    assert proc.returncode == 0, proc.stderr
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(bpe)
    for text in TEXTS:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf_tok.eos_token_id == ours.eod_id
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model.config.vocab_size >= ours.vocab_size
    cfg = load_config(overrides=[f"model.init_from={out}"])
    apply_init_from(cfg)
    assert cfg.data.tokenizer == str(out / "tokenizer.json")
