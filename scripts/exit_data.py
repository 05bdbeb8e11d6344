#!/usr/bin/env python3
"""Writes the record file `specee train-exit` (and the Gemma draft head) were trained on: every chat record of
the draft-training split plus 60 of its texts, shuffled with a fixed seed, so that `--limit N` takes a mix.

    python3 scripts/draft_data.py data/draft --max-man 300    # the draft-training split (see heads/README.md)
    python3 scripts/exit_data.py data/draft/train.jsonl data/exit/train.jsonl
"""
import json
import random
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: exit_data.py DRAFT_TRAIN.jsonl OUT.jsonl")
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        records = [json.loads(line) for line in f if line.strip()]
    chat = [r for r in records if "messages" in r]
    text = [r for r in records if "text" in r]
    random.seed(1)
    random.shuffle(chat)
    random.shuffle(text)
    out = chat + text[:60]
    random.shuffle(out)
    with open(dst, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in out))
    print(f"{dst}: {len(out)} records ({len(chat)} chat, {min(60, len(text))} text)")


if __name__ == "__main__":
    main()
