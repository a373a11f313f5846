"""Parallel, resumable preprocessing: every input format, byte-identical output for any number of
workers, a SIGKILLed run continued by the same command, one-line errors from inside a worker."""
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dr_scale.data.indexed import IndexedDataset
from dr_scale.data.preprocess import parts_dir, preprocess
from dr_scale.data.text_files import plan_pieces
from dr_scale.data.tokenizer import load_tokenizer
from dr_scale.errors import DrScaleError
from tests.conftest import ROOT


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    from dr_scale.data.corpus import bundled_data

    return load_tokenizer(bundled_data(cache_dir, 4096)[0])


@pytest.fixture(scope="module")
def texts():
    from dr_scale.data.corpus import CORPUS

    chapters = [json.loads(line)["text"] for line in gzip.open(CORPUS, "rt")][:60]
    return [c[i:i + 700] for c in chapters for i in range(0, len(c), 700)]  # ~330 documents


def write_inputs(folder, texts):
    """The same documents spread over every supported format, in a known order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir(parents=True, exist_ok=True)
    n = len(texts) // 5
    lines = lambda docs: "".join(json.dumps({"body": t}) + "\n" for t in docs)  # noqa: E731
    (folder / "a.jsonl").write_text(lines(texts[:2 * n]) + "\n")  # a blank line is skipped
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.write(lines(texts[2 * n:3 * n]))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        lines(texts[3 * n:4 * n]).encode()))
    pq.write_table(pa.table({"body": texts[4 * n:-1]}), folder / "d.parquet", row_group_size=25)
    (folder / "e.txt").write_text(texts[-1])
    return [folder / x for x in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.txt")]


def test_every_format_and_any_worker_count_give_the_same_bytes(tmp_path, tokenizer, texts):
    inputs = write_inputs(tmp_path / "in", texts)
    pieces = plan_pieces(inputs, piece_bytes=8192)
    kinds = [p.kind for p in pieces]
    assert kinds.count("jsonl") > 10 and kinds.count("parquet") >= 2  # a.jsonl cut in many pieces
    outs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        meta = preprocess(inputs, tokenizer, prefix, text_key="body", workers=workers,
                          progress=False, piece_bytes=8192)
        outs[workers] = prefix
        assert meta["documents"] == len(texts) and not parts_dir(prefix).exists()
    for ext in (".bin", ".idx"):
        assert sha(outs[1].with_suffix(ext)) == sha(outs[2].with_suffix(ext))
    data = IndexedDataset(outs[2])
    for i in (0, len(texts) // 2, len(texts) - 1):  # in input order, each with its EOD
        doc = data.document(i)
        assert tokenizer.decode(doc[:-1]) == texts[i] and int(doc[-1]) == tokenizer.eod_id
    # the sequential reference: one piece a file, in one process
    whole = preprocess(inputs, tokenizer, tmp_path / "whole", text_key="body", progress=False,
                       piece_bytes=1 << 40)
    assert whole["tokens"] == IndexedDataset(outs[1]).num_tokens()
    assert sha((tmp_path / "whole").with_suffix(".bin")) == sha(outs[1].with_suffix(".bin"))


def cli_preprocess(inputs, out, *extra, **kw):
    return subprocess.Popen([sys.executable, "-m", "dr_scale.cli", "preprocess", "--input",
                             *map(str, inputs), "--tokenizer", str(kw["tokenizer"]), "--out",
                             str(out), *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_killed_run_continues_where_it_stopped(tmp_path, tokenizer, texts):
    """SIGKILL to a 2-worker run once some pieces are written; the same command then reports
    how many were done, finishes, and writes the bytes of an uninterrupted run."""
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for k in range(12):
            f.writelines(json.dumps({"text": f"{k} {t}"}) + "\n" for t in texts)
    args = ("--workers", "2", "--piece_mib", "0.05")
    proc = cli_preprocess([big], tmp_path / "out", *args, tokenizer=tokenizer.path)
    work = parts_dir(tmp_path / "out")
    deadline = time.time() + 120
    while len(list(work.glob("piece_*.idx"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(work.glob("piece_*.idx")))
    total = len(plan_pieces([big], piece_bytes=int(0.05 * 2**20)))
    assert 3 <= done < total, (done, total)
    assert not (tmp_path / "out.bin").exists()
    again = cli_preprocess([big], tmp_path / "out", *args, tokenizer=tokenizer.path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"continuing {work}: " in err and f"of {total} pieces done" in err
    assert "% of " in err and "tokens/s" in err and "ETA" in err  # progress line
    clean = cli_preprocess([big], tmp_path / "clean", "--workers", "1", tokenizer=tokenizer.path)
    assert clean.wait(timeout=300) == 0
    for ext in (".bin", ".idx"):
        assert sha(tmp_path / f"out{ext}") == sha(tmp_path / f"clean{ext}")


def test_errors_inside_a_worker_are_one_line(tmp_path, tokenizer, texts):
    bad = tmp_path / "bad.jsonl"
    good = "".join(json.dumps({"text": t}) + "\n" for t in texts[:40])
    bad.write_text(good + '{"text": "fine"}\n{"txt": "wrong key"}\n' + good)
    with pytest.raises(DrScaleError, match=rf"^{bad}:42: expected a JSON object with a string "
                                           r"under 'text'$"):
        preprocess([bad], tokenizer, tmp_path / "o", workers=2, progress=False, piece_bytes=4096)
    assert not (tmp_path / "o.bin").exists()
    with pytest.raises(DrScaleError, match="left by an interrupted preprocess of other inputs"):
        preprocess([bad], tokenizer, tmp_path / "o", text_key="body", progress=False)
    with pytest.raises(DrScaleError, match=r"x\.csv: unknown input format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        preprocess([tmp_path / "x.csv"], tokenizer, tmp_path / "p", progress=False)
    with pytest.raises(DrScaleError, match=r"d\.parquet: no column 'text' \(columns: body\)"):
        inputs = write_inputs(tmp_path / "in", texts)
        preprocess([inputs[3]], tokenizer, tmp_path / "q", progress=False)
