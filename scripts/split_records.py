#!/usr/bin/env python3
"""Joins record files (JSON lines), shuffles them with a fixed seed and writes them back as N chunk files.

Training commands cache what they collect per record file (keyed by its content, `train::cache`), so a long
collection split into chunks resumes where it stopped: a rerun of the same command reuses every finished chunk.
Shuffling spreads each source over all chunks, so the first chunks collected are already a fair sample.

Usage: python3 scripts/split_records.py OUT_PREFIX --chunks N [--seed S] IN.jsonl [IN2.jsonl ...]
Writes OUT_PREFIX-00.jsonl … OUT_PREFIX-(N-1).jsonl and prints their record counts.
"""

import argparse
import os
import random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_prefix")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.chunks < 1:
        ap.error("--chunks must be at least 1")
    lines = []
    for path in a.inputs:
        with open(path, encoding="utf-8") as f:
            lines.extend(line for line in f if line.strip())
    random.Random(a.seed).shuffle(lines)
    os.makedirs(os.path.dirname(a.out_prefix) or ".", exist_ok=True)
    for c in range(a.chunks):
        part = lines[c :: a.chunks]
        path = f"{a.out_prefix}-{c:02d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(part)
        print(f"{path}: {len(part)} records")


if __name__ == "__main__":
    main()
