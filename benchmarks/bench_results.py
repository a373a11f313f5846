"""Where a benchmark's figures go: results.jsonl (a row a line, with the machine's facts) and
results.md (a title naming the machine, then a table), in its --out folder."""
import json
from pathlib import Path


def write_results(out, rows, title: str, columns, facts: dict = None):
    """`columns`: (header, key) pairs; a key is a row's field name or a function of the row."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, **(facts or {})}) + "\n")
    cell = lambda r, key: key(r) if callable(key) else r.get(key, "")  # noqa: E731
    lines = [title, "", "| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell(r, k)) for _, k in columns) + " |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.md'}")
