#!/usr/bin/env python3
"""Calibration text for `specee sparsity fit` (issue #39): the raw-text records ({"text": ...}: man pages and pydoc of
the standard library, made by `scripts/draft_data.py data/draft --max-man 300`) of a records file, joined by blank
lines, up to --max-chars. The held-out text the curves are measured on (../shared/reference/perplexity-text.txt, the
GPL) is of another source.

    python3 scripts/sparsity_calib.py data/draft/train.jsonl data/sparsity/calib.txt
"""
import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records")
    ap.add_argument("out")
    ap.add_argument("--max-chars", type=int, default=400_000)
    a = ap.parse_args()
    texts, size = [], 0
    with open(a.records, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "text" in r and size < a.max_chars:
                texts.append(r["text"].strip())
                size += len(texts[-1]) + 2
    if not texts:
        raise SystemExit(f"{a.records}: no text records")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n\n".join(texts)[: a.max_chars] + "\n")
    print(f"wrote {a.out}: {len(texts)} texts, {min(size, a.max_chars)} characters")


if __name__ == "__main__":
    main()
