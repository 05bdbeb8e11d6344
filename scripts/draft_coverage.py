#!/usr/bin/env python3
"""How much of a model's greedy output a draft head can propose at all, and what prompt lookup catches.

For each prompt of a prompt file (JSON lines with "messages" or "prompt"), runs `specee generate --mode dense`
(greedy) and reads the draft head's vocabulary (`d2t` of an `mlp` head file: draft id i is target id i + d2t[i]).
Prints, over all generated tokens: the share inside the draft vocabulary; of those outside it, the share that
appeared earlier in the context (prompt or answer so far); and, per class, how often a prompt-lookup guess (the
token that followed the latest occurrence of the longest matching 4-, 3- or 2-token suffix) is right.

    python3 scripts/draft_coverage.py -m qwen-coder --prompts bench/code-heldout.jsonl \
        --draft heads/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.draft.safetensors
"""
import argparse
import json
import struct
import subprocess


def draft_vocab(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start, end = header["d2t"]["data_offsets"]
        f.seek(8 + n + start)
        raw = f.read(end - start)
    d2t = struct.unpack("<%dq" % (len(raw) // 8), raw)
    return {i + off for i, off in enumerate(d2t)}


def lookup(ctx):
    for n in (4, 3, 2):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == suffix:
                return ctx[s + n]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen-coder")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--specee", default="./target/release/specee")
    a = ap.parse_args()
    vocab = draft_vocab(a.draft)
    classes = {"in draft vocabulary": [0, 0], "outside, seen in context": [0, 0], "outside, new": [0, 0]}
    for line in open(a.prompts):
        rec = json.loads(line)
        cmd = [a.specee, "generate", "-m", a.model, "--mode", "dense", "-n", str(a.n), "--json", "-t", "2"]
        if "messages" in rec:
            cmd += ["--chat", "-p", rec["messages"][-1]["content"]]
        else:
            cmd += ["-p", rec["prompt"]]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        ctx = list(out["prompt_ids"])
        for t in out["generated_ids"]:
            key = "in draft vocabulary" if t in vocab else (
                "outside, seen in context" if t in ctx else "outside, new")
            classes[key][0] += 1
            classes[key][1] += lookup(ctx) == t
            ctx.append(t)
    total = sum(c[0] for c in classes.values())
    print(f"{total} generated tokens")
    for k, (n, hit) in classes.items():
        print(f"  {k:26s} {n:6d} ({n / total:6.1%}), lookup right {hit / max(n, 1):6.1%}")


if __name__ == "__main__":
    main()
