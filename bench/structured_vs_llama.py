#!/usr/bin/env python3
"""Structured output side by side with llama.cpp's own `llama-server` (issue #37): the same JSON-schema chat
requests (the family of crates/cli/tests/server/structured_output.py: `response_format` json_schema, strict,
greedy, max_tokens 256) through the official `openai` client to `specee serve` and to `llama-server` (built by
scripts/build_llama_cpp.sh from the `llama-cpp-python` source), on the same model and threads, one request at a
time. llama-server turns the schema into its own GBNF grammar; we use llguidance. Prints per engine (and per
`specee.mode` given with --modes):

  valid      answers that parse and validate against their schema (`jsonschema`), and that ended with `stop`
  tokens     generated tokens over all answers (the servers' own `usage.completion_tokens`)
  e2e tok/s  tokens / wall seconds of the requests (HTTP, prompt and grammar compilation included)
  dec tok/s  tokens / decode seconds (each server's own timing of its generated tokens: llama-server's
             `timings.predicted_ms`, specee's `specee.decode_tokens_per_second`)
  s/answer   wall seconds per answer (llama-server's whitespace-flexible grammar lets the model write more
             tokens for the same JSON: newlines and indentation)

median and range over --repeat rounds (engines alternate within a round), then specee / llama-server ratios.
Answers may differ between the engines (different grammar engines and whitespace rules); the number of
identical texts is printed.

    python3 bench/structured_vs_llama.py -m smollm2 [--cases 12] [--repeat 3] [--modes eagle,dense] [-t 2]
Needs: the `openai` and `jsonschema` packages, target/release/specee, scripts/build_llama_cpp.sh's llama-server.
"""
import argparse
import json
import os
import statistics
import sys
import time

import jsonschema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "crates", "cli", "tests", "server"))
from serve_bench import MODELS, Server, free_port  # noqa: E402
from structured_output import cases, validate  # noqa: E402


def ask(client, model, schema, prompt, mode):
    """One request: (text, finish_reason, completion tokens, wall seconds, decode seconds)."""
    t0 = time.time()
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=256,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        extra_body={"specee": {"mode": mode}} if mode else None,
    )
    wall = time.time() - t0
    extra = r.model_extra or {}
    n = r.usage.completion_tokens
    if "timings" in extra:  # llama-server
        decode = extra["timings"]["predicted_ms"] / 1000
    else:
        rate = extra["specee"]["decode_tokens_per_second"]
        decode = n / rate if rate > 0 else wall
    return r.choices[0].message.content, r.choices[0].finish_reason, n, wall, decode


def valid(text, schema):
    try:
        validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="eagle,dense", help="specee.mode values to run (comma-separated)")
    ap.add_argument("--specee", default=os.path.join(ROOT, "target/release/specee"))
    ap.add_argument("--llama-server", dest="llama_server_path")
    a = ap.parse_args()
    gguf = os.path.join(ROOT, "models", MODELS.get(a.model, a.model)) if a.model in MODELS else a.model
    llama_path = a.llama_server_path or os.path.join(ROOT, "vendor/llama.cpp-0.3.36/build/bin/llama-server")
    if not os.path.exists(llama_path):
        raise SystemExit(f"{llama_path} not found: run scripts/build_llama_cpp.sh")

    port = free_port()
    ours = Server([a.specee, "serve", "-m", gguf, "--port", str(port), "-t", str(a.threads), "--parallel", "1"],
                  port, "specee serve")
    port = free_port()
    theirs = Server([llama_path, "-m", gguf, "-t", str(a.threads), "-tb", str(a.threads), "-c", "4096", "-np", "1",
                     "--host", "127.0.0.1", "--port", str(port)], port, "llama-server")
    engines = [(f"specee {m}", ours, m) for m in a.modes.split(",") if m] + [("llama-server", theirs, None)]
    work = cases(a.cases)
    results = {name: [] for name, _, _ in engines}
    texts = {}
    try:
        for name, server, mode in engines:  # warm-up (first grammar compilation, caches)
            ask(server.client(), "m", work[0][1], work[0][2], mode)
        for rnd in range(a.repeat):
            for name, server, mode in engines:
                client = server.client()
                tokens = wall = decode = 0
                ok = 0
                for case_name, schema, prompt in work:
                    text, finish, n, w, d = ask(client, "m", schema, prompt, mode)
                    good = valid(text, schema) and finish == "stop"
                    ok += good
                    if not good and rnd == 0:
                        print(f"{name} {case_name}: invalid ({finish}): {text[:160]!r}", file=sys.stderr)
                    tokens, wall, decode = tokens + n, wall + w, decode + d
                    texts[(name, case_name)] = text
                results[name].append({"valid": ok, "tokens": tokens, "e2e": tokens / wall, "dec": tokens / decode,
                                      "s": wall / len(work)})
                print(f"round {rnd + 1} {name}: {ok}/{len(work)} valid, {tokens} tokens, "
                      f"{tokens / wall:.1f} e2e tok/s, {tokens / decode:.1f} decode tok/s", file=sys.stderr, flush=True)
    finally:
        ours.stop()
        theirs.stop()

    def med(name, key):
        xs = [r[key] for r in results[name]]
        return statistics.median(xs), min(xs), max(xs)

    print(f"{a.model}, {a.threads} threads, {len(work)} schema answers, median (min-max) of {a.repeat} rounds")
    print(f"{'engine':<18} {'valid':>6} {'tokens':>7} {'e2e tok/s':>20} {'dec tok/s':>20} {'s/answer':>8}")
    for name, _, _ in engines:
        r = results[name][-1]
        e, d = med(name, "e2e"), med(name, "dec")
        print(f"{name:<18} {r['valid']:>3}/{len(work):<2} {r['tokens']:>7} "
              f"{e[0]:>7.1f} ({e[1]:.1f}-{e[2]:.1f}) {d[0]:>7.1f} ({d[1]:.1f}-{d[2]:.1f}) {med(name, 's')[0]:>8.2f}")
    llama_e2e, llama_dec, llama_s = (med("llama-server", k)[0] for k in ("e2e", "dec", "s"))
    for name, _, mode in engines[:-1]:
        same = sum(texts[(name, c[0])] == texts[("llama-server", c[0])] for c in work)
        print(f"{name} / llama-server: e2e {med(name, 'e2e')[0] / llama_e2e:.2f}x, "
              f"decode {med(name, 'dec')[0] / llama_dec:.2f}x, answers {llama_s / med(name, 's')[0]:.2f}x as fast; "
              f"identical answers {same}/{len(work)}")


if __name__ == "__main__":
    main()
