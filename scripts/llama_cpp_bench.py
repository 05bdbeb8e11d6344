#!/usr/bin/env python3
"""llama.cpp side of `specee bench --llama-cpp`: the same measurements through the llama-cpp-python package.

Prompt processing: a fresh context, P tokens in one batch. Decode: N single-token evals after a one-token
context. R repetitions after one warm-up. Prints one JSON object: {"prompt_tokens_per_s": [...],
"decode_tokens_per_s": [...], "version": ...}. Token ids come from the caller so both engines see the same input.
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--decode-ids", required=True, help="comma-separated ids fed one at a time")
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        sys.exit(3)
    prompt = [int(x) for x in a.prompt_ids.split(",") if x]
    decode = [int(x) for x in a.decode_ids.split(",") if x]
    n_ctx = max(len(prompt), len(decode)) + 16
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=n_ctx, n_batch=max(512, len(prompt)), n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)
    pp, tg = [], []
    for rep in range(a.reps + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        pp_s = len(prompt) / (time.perf_counter() - t)
        llm.reset()
        llm.eval(decode[:1])
        t = time.perf_counter()
        for tok in decode[1:]:
            llm.eval([tok])
        tg_s = (len(decode) - 1) / (time.perf_counter() - t)
        if rep > 0:
            pp.append(pp_s)
            tg.append(tg_s)
    print(json.dumps({"prompt_tokens_per_s": pp, "decode_tokens_per_s": tg,
                      "version": getattr(llama_cpp, "__version__", "?")}))


if __name__ == "__main__":
    main()
