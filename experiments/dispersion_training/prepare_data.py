"""Build the two domains of the push-away experiment from text installed on this machine (nothing is downloaded,
nothing is committed): English prose and Python source code, each split into train/test by document.

* prose: the paragraphs of the Python documentation shipped with Python (``pydoc_data.topics``) and, when the
  Debian package ``fortunes`` is installed (``apt-get install fortunes``), every English fortune cookie.
* code: the ``.py`` files of the running Python's standard library (tests excluded), one document per file.

A document goes to the test split when a hash of its text says so (``--test-fraction``, default 0.1), so the split
does not depend on file order. Each domain's training text is capped at ``--max-chars``, its test text at
``--max-test-chars`` (test documents are taken in hash order, so the cap is a fixed subset).

    .venv/bin/python experiments/dispersion_training/prepare_data.py --out /tmp/repgeom-exp/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")


def _key(text: str) -> float:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:12], 16) / 16**12


def prose_documents() -> tuple[list[str], list[str]]:
    from pydoc_data.topics import topics

    docs, sources = [], ["pydoc_data.topics"]
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= 80:
                docs.append(text)
    if FORTUNES.is_dir():
        files = sorted(p for p in FORTUNES.iterdir()
                       if p.is_file() and not p.is_symlink() and p.suffix != ".dat" and p.name not in ("art", "ascii-art"))
        for path in files:
            raw = path.read_text(encoding="utf-8", errors="replace")
            for cookie in raw.split("\n%\n"):
                text = cookie.strip()
                if len(text) >= 40:
                    docs.append(text)
        sources.append(f"fortunes ({len(files)} files in {FORTUNES})")
    return docs, sources


def code_documents() -> tuple[list[str], list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "test", "tests", "idle_test", "__pycache__") for p in rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 200:
            docs.append(text)
    return docs, [f"Python {sysconfig.get_python_version()} standard library ({root})"]


def split(docs: list[str], test_fraction: float, max_chars: int, max_test_chars: int):
    ranked = sorted(set(docs), key=_key)
    train, test, n_train, n_test = [], [], 0, 0
    for text in ranked:
        if _key(text) < test_fraction:
            if n_test < max_test_chars:
                test.append(text)
                n_test += len(text)
        elif n_train < max_chars:
            train.append(text)
            n_train += len(text)
    return train, test


def write_jsonl(path: Path, texts: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for {prose,code}_{train,test}.jsonl")
    ap.add_argument("--test-fraction", type=float, default=0.1)
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="training characters per domain")
    ap.add_argument("--max-test-chars", type=int, default=120_000, help="test characters per domain")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, make in (("prose", prose_documents), ("code", code_documents)):
        docs, sources = make()
        train, test = split(docs, args.test_fraction, args.max_chars, args.max_test_chars)
        write_jsonl(out / f"{name}_train.jsonl", train)
        write_jsonl(out / f"{name}_test.jsonl", test)
        summary[name] = {"sources": sources, "documents": len(docs), "train_docs": len(train),
                         "train_chars": sum(map(len, train)), "test_docs": len(test),
                         "test_chars": sum(map(len, test))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
