#!/usr/bin/env python3
"""Measures whether exit predictors that also read the hidden state beat the ones `specee train-exit` trains.

An experiment, not part of the engine or of CI (needs numpy: `pip install numpy`). Input: a `specee
train-exit` trace (`EXIT.trace.<stem>.safetensors`) and the normed states of layers FIRST.. that
`--keep-states FIRST` wrote beside it (`EXIT.states.<stem>.f16`: f16, tokens x layers x d). For each of those
layers it trains two MLPs with the same recipe (Adam, binary cross-entropy, the epoch with the lowest loss on
the dev records, index 1 mod 5) on the training records (index 2-4 mod 5, plus every record of `--extra`
files):

  A: the 18 features `train-exit --features 18` reads (candidates' logits, probabilities, their change
     since the layer before, the draft's log-probabilities, the layer's update),
  B: the same plus the normed hidden state (d more inputs into the hidden layer),

and reports, on the validation records (index a multiple of 5), each layer's exit rate at a fixed precision,
then a first-exit simulation over the layers (exit at the first layer whose predictor clears one threshold;
agreement with dense and layers run per token): the fewest layers, and the share of tokens exiting, at
agreements of 0.995 to 0.9995.

    specee train-exit -m qwen-coder --data data/exit/train-code.jsonl --limit 400 \
        --out data/exit/s69/exit.safetensors --keep-states 12 --target-agreement 0.999 -t 2
    python3 scripts/exit_probe.py data/exit/s69/exit.trace.train-code.safetensors \
        data/exit/s69/exit.states.train-code.f16 --wd 1e-2
"""
import argparse
import json
import struct
import sys

import numpy as np

CAND = 4


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    types = {"F32": np.float32, "U32": np.uint32, "I32": np.int32}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=types[t["dtype"]]).reshape(t["shape"])
    return out, meta


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def features(tr, layer):
    s = tr["s"][:, layer, :].astype(np.float64)
    p = softmax(s)
    q = softmax(tr["s"][:, layer - 1, :].astype(np.float64))
    upd = tr["upd"][:, layer, :] if "upd" in tr else np.zeros((len(s), 2))
    return np.concatenate([s, p, p - q, tr["cand_lp"], upd], axis=1).astype(np.float32)


def labels(tr, layer):
    best = tr["s"][:, layer, :].argmax(axis=1)
    return (tr["cand"][np.arange(len(best)), best] == tr["target"]).astype(np.float32)


class Mlp:
    def __init__(self, n_in, hidden, rng):
        self.w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
        self.b1 = np.zeros(hidden, np.float32)
        self.w2 = (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32)
        self.b2 = np.zeros(1, np.float32)
        self.params = [self.w1, self.b1, self.w2, self.b2]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.t = 0

    def logit(self, x):
        h = np.maximum(x @ self.w1 + self.b1, 0)
        return (h @ self.w2 + self.b2)[:, 0], h

    def step(self, x, y, lr, wd):
        z, h = self.logit(x)
        p = 1 / (1 + np.exp(-z))
        g = ((p - y) / len(y)).astype(np.float32)[:, None]
        gw2 = h.T @ g
        gb2 = g.sum(0)
        gh = (g @ self.w2.T) * (h > 0)
        gw1 = x.T @ gh
        gb1 = gh.sum(0)
        self.t += 1
        for i, (pp, gg) in enumerate(zip(self.params, [gw1 + wd * self.w1, gb1, gw2 + wd * self.w2, gb2])):
            self.m[i] = 0.9 * self.m[i] + 0.1 * gg
            self.v[i] = 0.999 * self.v[i] + 0.001 * gg * gg
            mh = self.m[i] / (1 - 0.9**self.t)
            vh = self.v[i] / (1 - 0.999**self.t)
            pp -= lr * mh / (np.sqrt(vh) + 1e-8)

    def prob(self, x):
        return 1 / (1 + np.exp(-self.logit(x)[0]))


def train(x, y, xd, yd, hidden, epochs, lr, wd, seed):
    """Adam on BCE; keeps the epoch with the lowest dev loss."""
    rng = np.random.default_rng(seed)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    x, xd = (x - mu) / sd, (xd - mu) / sd
    m = Mlp(x.shape[1], hidden, rng)
    best, keep = np.inf, None
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for i in range(0, len(y), 512):
            j = order[i : i + 512]
            m.step(x[j], y[j], lr, wd)
        p = np.clip(m.prob(xd), 1e-7, 1 - 1e-7)
        loss = -np.mean(yd * np.log(p) + (1 - yd) * np.log(1 - p))
        if loss < best:
            best, keep = loss, [q.copy() for q in m.params]
    m.w1[:], m.b1[:], m.w2[:], m.b2[:] = keep
    return lambda z: m.logit((z - mu) / sd)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("states")
    ap.add_argument("--extra", nargs=2, action="append", default=[], metavar=("TRACE", "STATES"),
                    help="another record file's trace and states: all of it trains (repeatable)")
    ap.add_argument("--first", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--train-frac", type=float, default=1.0, help="train on this share of the training records")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default="", help="comma-separated subset of layers to train (default all)")
    a = ap.parse_args()
    tr, meta = load_safetensors(a.trace)
    n_layers = int(meta["n_layers"])
    probe = list(range(a.first, n_layers))

    def states_of(trace, path):
        n = len(trace["target"])
        st = np.memmap(path, dtype=np.float16, mode="r")
        d = len(st) // (n * len(probe))
        if d * n * len(probe) != len(st):
            sys.exit(f"{path}: {len(st)} values do not fit {n} tokens x {len(probe)} layers")
        return st.reshape(n, len(probe), d)

    st = states_of(tr, a.states)
    d = st.shape[2]
    group = tr["group"].astype(np.int64)
    parts, sts = [tr], [st]
    for k, (tpath, spath) in enumerate(a.extra):
        t2, _ = load_safetensors(tpath)
        parts.append(t2)
        sts.append(states_of(t2, spath))
        # Extra files train only: their records get indices that are never validation or dev (2 mod 5).
        group = np.concatenate([group, 5 * (100000 * (k + 1) + t2["group"].astype(np.int64)) + 2])
    tr = {key: np.concatenate([p[key] for p in parts]) for key in tr}
    T = len(tr["target"])
    val = group % 5 == 0
    dev = (~val) & (group % 5 == 1)
    trn = (~val) & (~dev) & ((group * 7919) % 100 < a.train_frac * 100)

    def state_rows(L):
        return np.concatenate([s[:, L - a.first, :].astype(np.float32) for s in sts])

    print(f"{T} tokens, d {d}, layers {probe[0]}..{probe[-1]}; train {trn.sum()} dev {dev.sum()} val {val.sum()}")
    reach = (tr["cand"] == tr["target"][:, None]).any(1)
    print(f"dense top-1 among the candidates: {reach.mean():.3f}")
    layers = [int(x) for x in a.layers.split(",")] if a.layers else probe
    # Per-token, per-layer logits of the exit probability (ranking by logit avoids ties where p rounds to 1).
    probs = {"A": np.full((val.sum(), n_layers), -np.inf), "B": np.full((val.sum(), n_layers), -np.inf)}
    lab = np.zeros((val.sum(), n_layers), bool)
    for L in range(n_layers):
        lab[:, L] = labels(tr, L)[val] > 0
    for L in layers:
        f = features(tr, L)
        h = state_rows(L)
        y = labels(tr, L)
        for name, x in (("A", f), ("B", np.concatenate([f, h], 1))):
            pred = train(x[trn], y[trn], x[dev], y[dev], a.hidden, a.epochs, a.lr, a.wd, seed=L + 1000 * a.seed)
            p = pred(x[val])
            probs[name][:, L] = p
        row = [f"layer {L:2d}: label rate {y[val].mean():.3f}"]
        for name in "AB":
            p, yy = probs[name][:, L], lab[:, L]
            for prec in (0.999, 0.9995):
                o = np.argsort(-p)
                cum = np.cumsum(~yy[o])
                k = np.nonzero(cum <= (1 - prec) * np.arange(1, len(o) + 1))[0]
                rate = (k.max() + 1) / len(o) if len(k) else 0.0
                row.append(f"{name}@{prec}: {rate:.3f}")
        print("  ".join(row), flush=True)
    # First-exit simulation: one threshold for every layer, exit at the first layer whose logit exceeds it;
    # a fine sweep of thresholds, then the fewest layers run at each target agreement with dense.
    print("first-exit simulation on the validation tokens (fewest layers run per token at an agreement):")
    idx = np.arange(val.sum())
    for name in "AB":
        curve = []
        for z in np.linspace(-2, 16, 181):
            ex = probs[name][:, layers] > z
            first = np.where(ex.any(1), ex.argmax(1), -1)
            at = np.array(layers)[np.maximum(first, 0)]
            ran = np.where(first >= 0, at + 1, n_layers)
            ok = np.where(first >= 0, lab[idx, at], True)
            curve.append((ok.mean(), ran.mean(), np.mean(first >= 0)))
        row = [f"  {name}:"]
        for target in (0.995, 0.998, 0.999, 0.9995):
            fit = [c for c in curve if c[0] >= target]
            best = min(fit, key=lambda c: c[1]) if fit else (1.0, float(n_layers), 0.0)
            row.append(f"@{target}: {best[1]:.2f} layers, {best[2]:.3f} exits")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
