#!/usr/bin/env python3
"""Lookup-only decoding simulated forward by forward on dense greedy answers (dump.sh): each forward drafts a prompt-
lookup chain whose length a policy picks (the shipped one: 3, doubling up to 12 while accepted whole; or by the
length of the matched suffix), commits the accepted tokens + 1, and costs what a forward of that many rows costs
(COST: Qwen2.5-Coder kprof, rows -> time of one row). Usage: python3 bench/lookup/policy.py IDS.jsonl"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim import cont, match_len
COST = {1: 1.0, 2: 1.07, 4: 1.25, 8: 1.56, 12: 2.2, 16: 2.72}
def cost(r):
    ks = sorted(COST)
    for a, b in zip(ks, ks[1:]):
        if a <= r <= b: return COST[a] + (COST[b] - COST[a]) * (r - a) / (b - a)
    return COST[16] * r / 16

def run(recs, policy):
    toks = fw = rows = c_sum = 0
    for r in recs:
        p, g = r["p"], r["g"]
        i, state = 0, {"len": 3, "last": None}
        while i < len(g):
            ctx = p + g[:i]
            L, _ = match_len(ctx, 32)
            c = policy(L, state)
            extra, a = [], 0
            for k in range(c):
                t, _ = cont(ctx, extra)
                if t is None: break
                extra.append(t)
            for k, t in enumerate(extra):
                if i + k < len(g) and g[i + k] == t: a += 1
                else: break
            state["whole"] = len(extra) > 0 and a == len(extra)
            state["drafted"] = len(extra)
            commit = min(a + 1, len(g) - i)
            i += commit; toks += commit; fw += 1; rows += 1 + len(extra); c_sum += cost(1 + len(extra))
    return toks / fw, rows / fw, toks / c_sum

def current(base=3, growth=4):
    def pol(L, st):
        if st.get("whole"): st["len"] = min(2 * st["len"], growth * base)
        else: st["len"] = base
        return st["len"]
    return pol

def by_len(table, double=True, cap=16):
    def pol(L, st):
        c = 0
        for lo, n in table:
            if L >= lo: c = n
        if double and st.get("whole"): c = max(c, min(2 * st.get("drafted", 0), cap))
        return c
    return pol

recs = [json.loads(l) for l in open(sys.argv[1])]
pols = {
    "current 3 x4": current(),
    "current 2 x4": current(2),
    "len: 2->1,4->3,8->8": by_len([(2, 1), (4, 3), (8, 8)]),
    "len: 2->2,4->4,8->8,16->12": by_len([(2, 2), (4, 4), (8, 8), (16, 12)]),
    "len: 2->2,6->6,12->12": by_len([(2, 2), (6, 6), (12, 12)]),
    "len: 2->3,8->8": by_len([(2, 3), (8, 8)]),
    "len: 2->3,8->12": by_len([(2, 3), (8, 12)]),
    "len: 2->1,3->3,6->8,12->12": by_len([(2, 1), (3, 3), (6, 8), (12, 12)]),
    "len nodbl: 2->2,4->4,8->8,16->12": by_len([(2, 2), (4, 4), (8, 8), (16, 12)], double=False),
}
for name, pol in pols.items():
    tau, rows, eff = run(recs, pol)
    print(f"{name:36s} tau {tau:5.2f} rows {rows:5.2f} tokens/cost {eff:5.3f}")
