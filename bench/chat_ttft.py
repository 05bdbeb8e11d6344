#!/usr/bin/env python3
"""Time to first token of a chat turn whose history is long: `specee chat` (the KV cache kept between turns) vs
running the whole conversation again (`specee generate --messages`, what a client without a cache pays).

The history is one user message holding a long text (by default docs/server.md, cut to about --history tokens)
and the model's answer; the measured turn is the question after it. For each mode and round:
  1. `specee chat` reads the history (/load), answers a first question (this prefills the history), then the
     measured question; /stats reports how many prompt tokens came from the cache and how long the rest took;
  2. `specee generate --messages` runs the same conversation up to the measured question from scratch.
Both figures are the time from the prompt to the first answer token's logits (dense: the prompt forward; the tree
modes: the prompt forward without its last token, which the first verify step runs).

    python3 bench/chat_ttft.py -m smollm2 --modes dense,eagle --rounds 3
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "specee")


def run(args, stdin=None):
    p = subprocess.run([BIN, *args], input=stdin, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"specee {' '.join(args)} failed:\n{p.stderr}")
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--modes", default="dense,eagle")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--history-file", default=os.path.join(ROOT, "docs", "server.md"))
    ap.add_argument("--history-chars", type=int, default=4500, help="characters of the file in the history")
    a = ap.parse_args()
    text = open(a.history_file, encoding="utf-8").read()[: a.history_chars]
    tmp = tempfile.mkdtemp(prefix="specee-ttft-")
    history = [{"role": "user", "content": "Here is a document:\n\n" + text + "\n\nWhat is it about?"}]
    history_file = os.path.join(tmp, "history.json")
    first_q, measured_q = "Summarize it in one sentence.", "Which command starts the server?"
    rows = []
    for mode in a.modes.split(","):
        cached, fresh, prompt_tokens = [], [], 0
        for r in range(a.rounds):
            with open(history_file, "w") as f:
                json.dump(history, f)
            saved = os.path.join(tmp, f"conversation-{mode}-{r}.json")
            script = f"/load {history_file}\n{first_q}\n{measured_q}\n/stats\n/save {saved}\n"
            p = run(["chat", "-m", a.model, "-t", a.threads, "--mode", mode, "-n", "32", "-c", "4096"], script)
            stats = [l for l in p.stderr.splitlines() if l.startswith("last answer:")][-1]
            m = re.search(r"prompt (\d+) tokens, (\d+) from the cache, the other (\d+) run in ([\d.]+) ms", stats)
            if not m:
                sys.exit(f"no /stats line in:\n{p.stderr}")
            prompt_tokens, reused = int(m.group(1)), int(m.group(2))
            cached.append(float(m.group(4)))
            conversation = json.load(open(saved))[:-1]
            upto = os.path.join(tmp, f"upto-{mode}-{r}.json")
            json.dump(conversation, open(upto, "w"))
            g = run(["generate", "-m", a.model, "-t", a.threads, "--mode", mode, "-n", "1", "--messages", upto,
                     "--json", "-c", "4096"])
            v = json.loads(g.stdout)
            assert v["timings"]["prompt_tokens"] == prompt_tokens, (v["timings"], prompt_tokens)
            fresh.append(1000.0 * v["timings"]["prompt_seconds"])
            print(f"{mode} round {r + 1}: {prompt_tokens} prompt tokens ({reused} cached): "
                  f"{cached[-1]:.1f} ms with the cache, {fresh[-1]:.1f} ms without", flush=True)
        c, f = statistics.median(cached), statistics.median(fresh)
        rows.append((mode, prompt_tokens, c, f))
    print("\n| mode | prompt tokens | TTFT with the cache (ms) | re-prefilled (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for mode, n, c, f in rows:
        print(f"| {mode} | {n} | {c:.1f} | {f:.1f} | {f / c:.1f}× |")


if __name__ == "__main__":
    main()
