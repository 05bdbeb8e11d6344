#!/usr/bin/env python3
"""Would a low-bit copy of the output head let greedy decoding skip most of the exact head product?

For each of 200 held-out final-normed features x (a draft-data cache written by `specee train-draft`), computes
approximate logits with a b-bit copy of the head (symmetric, per 32 values), a rigorous per-row error bound
||w - w_b|| * ||x|| (Cauchy-Schwarz), and counts the rows that could still be the argmax (upper bound >= the best
lower bound): those would need the exact product. Checks that the true argmax always survives.

    python3 scripts/head_prescreen.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        data/draft/smollm2x/head.heldout-data.safetensors

Needs the `gguf` and `numpy` packages (pip). An analysis tool; nothing in the engine uses it.
"""
import json
import struct
import sys

import gguf
import numpy as np


def main(model_path, data_path, n=200):
    reader = gguf.GGUFReader(model_path)
    names = {t.name: t for t in reader.tensors}
    t = names.get("output.weight") or names["token_embd.weight"]
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    vocab, d = w.shape
    raw = open(data_path, "rb").read()
    hlen = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + hlen])
    s, e = header["features"]["data_offsets"]
    feats = np.frombuffer(raw[8 + hlen + s:8 + hlen + e], dtype=np.float16).reshape(-1, d).astype(np.float32)
    rows = np.where(np.abs(feats).sum(1) > 0)[0]
    picked = np.random.default_rng(0).choice(rows, min(n, len(rows)), replace=False)
    blocks = w.reshape(vocab, d // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    print(f"{t.name}: {vocab} x {d}, {len(picked)} features")
    for bits in (4, 5, 6):
        qmax = 2 ** (bits - 1) - 1
        step = amax / qmax + 1e-30
        approx = (np.clip(np.round(blocks / step), -qmax - 1, qmax) * step).reshape(vocab, d).astype(np.float32)
        err = np.linalg.norm(w - approx, axis=1)
        survivors = []
        for i in picked:
            x = feats[i]
            a = approx @ x
            bound = err * np.linalg.norm(x) * 1.001 + 1e-3
            alive = a + bound >= np.max(a - bound)
            assert alive[np.argmax(w @ x)], "the true argmax must survive"
            survivors.append(int(alive.sum()))
        sv = np.array(survivors)
        print(f"{bits} bits: rows needing the exact product: median {np.median(sv):.0f}, "
              f"p90 {np.percentile(sv, 90):.0f}, max {sv.max()} of {vocab}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
