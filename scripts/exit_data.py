#!/usr/bin/env python3
"""Writes the record file `specee train-exit` (and the Gemma draft head) were trained on: every chat record of
the draft-training split plus 60 of its texts, shuffled with a fixed seed, so that `--limit N` takes a mix.

    python3 scripts/draft_data.py data/draft --max-man 300    # the draft-training split (see heads/README.md)
    python3 scripts/exit_data.py data/draft/train.jsonl data/exit/train.jsonl

`--mix FILE` (repeatable) adds FILE's chat records to the shuffle (Qwen2.5-Coder's predictors: code prompts from
`scripts/code_prompts.py --train N`), so that `--limit N` takes a mix of them too.
"""
import json
import random
import sys


def main() -> None:
    args, mix = sys.argv[1:], []
    while "--mix" in args:
        i = args.index("--mix")
        if i + 1 >= len(args):
            sys.exit("--mix needs a file")
        mix.append(args[i + 1])
        del args[i : i + 2]
    if len(args) != 2:
        sys.exit("usage: exit_data.py DRAFT_TRAIN.jsonl OUT.jsonl [--mix FILE ...]")
    src, dst = args
    with open(src) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for path in mix:
        with open(path) as f:
            records += [r for r in (json.loads(line) for line in f if line.strip()) if "messages" in r]
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
