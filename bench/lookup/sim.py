#!/usr/bin/env python3
"""Offline prompt-lookup analysis on dense greedy answers (dump.sh writes them): how often the lookup's next token is
right given the length of the longest earlier match of the context's suffix, and how long its run of right tokens is.
`cont` is the n-gram proposer's continuation (crates/decode/src/speculative/ngram.rs: longest suffix of 4..2 tokens,
most frequent follower, ties to the most recent). Usage: python3 bench/lookup/sim.py IDS.jsonl"""
import json, sys
from collections import defaultdict

def cont(ctx, extra, min_n=2, max_n=4, window=4096):
    seq = ctx + extra
    searched = ctx[-window:]
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suf = seq[-n:]
        counts = {}
        for end in range(len(searched) - 1, n - 1, -1):
            if searched[end - n:end] == suf:
                t = searched[end]
                if t in counts: counts[t][0] += 1
                else: counts[t] = [1, end]
        if counts:
            best = max(counts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            return best[0], n
    return None, 0

def match_len(ctx, cap=64):
    """Longest suffix of ctx (up to cap) that occurs earlier in ctx, and the token after its latest occurrence."""
    best, tok = 0, None
    n = 2
    while n <= min(cap, len(ctx) - 1):
        suf = ctx[-n:]
        found = None
        for end in range(len(ctx) - 1, n - 1, -1):
            if ctx[end - n:end] == suf:
                found = ctx[end]; break
        if found is None: break
        best, tok = n, found
        n += 1
    return best, tok

def main():
    recs = [json.loads(l) for l in open(sys.argv[1])]
    stats = defaultdict(lambda: [0, 0, 0])  # bucket -> positions, first right, run length sum
    def bucket(L):
        for b in (0, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
            if L <= b: return b
        return 999
    for r in recs:
        p, g = r["p"], r["g"]
        for i in range(len(g)):
            ctx = p + g[:i]
            L, _ = match_len(ctx)
            # lookup chain as implemented (max_n 4), run length of correct tokens
            run, extra = 0, []
            for k in range(16):
                if i + k >= len(g): break
                t, _ = cont(ctx, extra)
                if t is None or t != g[i + k]: break
                run += 1; extra.append(t)
            s = stats[bucket(L)]
            s[0] += 1; s[1] += (run > 0); s[2] += run
    tot = sum(s[0] for s in stats.values())
    print(f"{tot} positions")
    print("match<=  share  P(first right)  E[run]  E[run|first right]")
    for b in sorted(stats):
        n, f, run = stats[b]
        print(f"{b:6d} {n/tot:6.3f} {f/n:14.3f} {run/n:7.2f} {run/max(f,1):8.2f}")


if __name__ == "__main__":
    main()
