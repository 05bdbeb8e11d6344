#!/usr/bin/env python3
"""Serving benchmark: `specee serve` under C concurrent streaming clients, side by side with llama.cpp's own
`llama-server` on the same model, threads and prompts (issue #32).

For each concurrency C it sends R requests (`--requests`, default 4 × C, at least 16) from C threads, each an
official `openai` client streaming a chat completion (greedy, `--max-tokens` N) of the next prompt of the prompt
file (JSONL with `messages`, as bench/chat-heldout.jsonl, or raw `prompt`s sent to completions, as
bench/plain-heldout.jsonl for Gemma 3, which has no chat template), and prints per engine:
  tok/s       generated tokens of all requests / wall seconds of the whole level (aggregate decode throughput),
              median of `--rounds` runs (default 3, alternating over the levels) with min–max;
  ×1          that over the same engine's throughput at 1 client;
  TTFT p50/p99, ITL p50/p99   time to first content chunk and between content chunks, milliseconds;
and, with --llama-server, specee / llama-server throughput at each C. Generated tokens are the server's own
`usage.completion_tokens` (stream_options include_usage). One server process per engine serves every level
(specee: `--parallel max(C)`; llama-server: `-np max(C)` slots of `--ctx` tokens each, continuous batching).

`--prefix` measures the prefix cache instead: a chat whose first turn is >= 1,000 tokens (a long document and a
question), answered; then a second turn resending the first turn's messages and the answer; the second turn's time
to first token with `--prefix-cache 0` and with the default cache (median of `--repeat` runs, each on a fresh
document so no earlier run helps) and their ratio.

Usage: bench/serve_bench.py [-m smollm2] [-t 2] [--clients 1,4,8,16] [--max-tokens 64] [--prompts FILE]
                            [--llama-server [--llama-clients 1,4,8]] [--prefix [--plain]] [--rounds 3]
                            [--specee target/release/specee]
Needs: the `openai` package; --llama-server: scripts/build_llama_cpp.sh's llama-server.
"""
import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from llama_server_bench import free_port, wait_ready  # noqa: E402 - the same helpers as `specee bench --llama-cpp`
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
    "qwen-coder": "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
}


class Server:
    """A server process on a free loopback port; stopped on exit."""

    def __init__(self, cmd, port, name):
        self.name, self.port = name, port
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not wait_ready(port, self.proc, seconds=180):
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()[-3:] \
                if self.proc.poll() is not None else ["no answer on /health"]
            raise SystemExit(f"{name} did not start: {' | '.join(err)}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def client(self):
        import openai
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                             timeout=90)


def specee_server(a, model, parallel, prefix_cache=None):
    port = free_port()
    cmd = [a.specee, "serve", "-m", model, "--port", str(port), "-t", str(a.threads), "--parallel", str(parallel),
           "--queue", "256", "-c", str(a.ctx)]
    if prefix_cache is not None:
        cmd += ["--prefix-cache", str(prefix_cache)]
    cmd += a.serve_args.split()
    return Server(cmd, port, "specee serve")


def llama_server(a, model, parallel):
    path = a.llama_server_path or os.path.join(ROOT, "vendor/llama.cpp-0.3.36/build/bin/llama-server")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: run scripts/build_llama_cpp.sh")
    port = free_port()
    cmd = [path, "-m", model, "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.ctx * parallel),
           "-np", str(parallel), "--threads-http", str(parallel + 4), "--host", "127.0.0.1", "--port", str(port)]
    return Server(cmd, port, "llama-server")


def one_request(client, item, max_tokens):
    """Streams one completion of `item` (a list of chat messages, or a raw prompt string for models without a chat
    template); returns (completion tokens, ttft s, [inter-chunk s])."""
    t0 = time.perf_counter()
    common = dict(model="m", max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    if isinstance(item, str):
        stream = client.completions.create(prompt=item, **common)
    else:
        stream = client.chat.completions.create(messages=item, **common)
    first, last, gaps, tokens, chunks = None, None, [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        c = chunk.choices[0] if chunk.choices else None
        text = (c.text if isinstance(item, str) else (c.delta.content if c.delta else None)) if c else None
        if text:
            now = time.perf_counter()
            chunks += 1
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
    return (tokens if tokens is not None else chunks), (first if first is not None else time.perf_counter() - t0), gaps


def run_level(server, prompts, clients, requests, max_tokens):
    work = queue.Queue()
    for i in range(requests):
        work.put(prompts[i % len(prompts)])
    results, errors, lock = [], [], threading.Lock()

    def worker():
        client = server.client()
        while True:
            try:
                messages = work.get_nowait()
            except queue.Empty:
                return
            try:
                r = one_request(client, messages, max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        print(f"  {server.name}: {len(errors)} failed request(s), first: {errors[0]}", file=sys.stderr)
    tokens = sum(r[0] for r in results)
    ttft = [r[1] for r in results]
    gaps = [g for r in results for g in r[2]]
    return {"tok_s": tokens / wall, "tokens": tokens, "wall": wall, "requests": len(results),
            "ttft": ttft, "itl": gaps, "failed": len(errors)}


def batch_counters(server):
    """specee's `/metrics` sums and counts of rows and requests per batched forward (None for other servers)."""
    if server.name != "specee serve":
        return None
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as f:
        text = f.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("specee_batch_rows_sum", "specee_batch_rows_count", "specee_batch_sequences_sum",
                    "specee_batch_step_seconds_sum"):
            values[name] = float(value)
    return values


def per_forward(before, after, wall):
    """Mean rows and requests per forward, ms per step, and the share of `wall` seconds spent in steps, between
    two `batch_counters` readings."""
    if not before or not after:
        return None
    forwards = after.get("specee_batch_rows_count", 0) - before.get("specee_batch_rows_count", 0)
    if forwards <= 0:
        return None
    rows = after.get("specee_batch_rows_sum", 0) - before.get("specee_batch_rows_sum", 0)
    seqs = after.get("specee_batch_sequences_sum", 0) - before.get("specee_batch_sequences_sum", 0)
    busy = after.get("specee_batch_step_seconds_sum", 0) - before.get("specee_batch_step_seconds_sum", 0)
    return rows / forwards, seqs / forwards, busy / forwards * 1000, busy / wall


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def load_prompts(path):
    """Chat messages (`{"messages": [...]}` lines) or raw prompts (`{"prompt": "..."}`, completions)."""
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    return [r["messages"] if "messages" in r else r["prompt"] for r in rows]


def throughput(a, model, prompts):
    levels = [int(c) for c in a.clients.split(",")]
    llama_levels = [int(c) for c in a.llama_clients.split(",")] if a.llama_clients else levels
    engines = [("specee", lambda: specee_server(a, model, max(levels)), levels)]
    if a.llama_server:
        engines.append(("llama-server", lambda: llama_server(a, model, max(llama_levels)), llama_levels))
    table = {}
    for name, start, levels_here in engines:
        server = start()
        try:
            # Warm-up: the head screen, the caches, the page cache.
            run_level(server, prompts, 1, 2, 16)
            # Rounds alternate over the levels, so that a slow spell of the machine does not hit one level only.
            for rnd in range(a.rounds):
                for c in levels_here:
                    n = a.requests or max(16, 4 * c)
                    before = batch_counters(server)
                    r = run_level(server, prompts, c, n, a.max_tokens)
                    shape = per_forward(before, batch_counters(server), r["wall"])
                    prev = table.setdefault((name, c), {"runs": [], "ttft": [], "itl": [], "stalled": 0,
                                                        "shape": []})
                    if r["failed"]:
                        # A round with requests that failed (llama-server 0.3.36 stalls under concurrent streams,
                        # then the client times out) measures the stall, not the throughput: left out, counted.
                        prev["stalled"] += 1
                        continue
                    prev["runs"].append(r["tok_s"])
                    prev["ttft"] += r["ttft"]
                    prev["itl"] += r["itl"]
                    if shape:
                        prev["shape"].append(shape)
                    shown = (f", {shape[0]:.1f} rows / {shape[1]:.1f} requests per forward, {shape[2]:.1f} ms a step, "
                             f"steps {100 * shape[3]:.0f}% of the wall time") if shape else ""
                    print(f"  {name} round {rnd + 1} C={c}: {r['requests']} requests, {r['tokens']} tokens in "
                          f"{r['wall']:.1f} s: {r['tok_s']:.1f} tok/s{shown}", file=sys.stderr)
            for c in levels_here:
                t = table[(name, c)]
                t["tok_s"] = statistics.median(t["runs"]) if t["runs"] else float("nan")
        finally:
            server.stop()
    print(f"\n{os.path.basename(model)}, {a.threads} thread(s), {a.max_tokens} tokens per request at most, greedy, "
          f"prompts {os.path.relpath(a.prompts, ROOT)}; tok/s: median of {a.rounds} rounds (min–max)\n")
    head = "| clients | specee tok/s | ×1 client | TTFT p50 / p99 ms | ITL p50 / p99 ms | rows / requests a forward | ms a step (% of wall) |"
    sep = "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    if a.llama_server:
        head += " llama-server tok/s | ×1 client | ITL p50 / p99 ms | specee / llama-server |"
        sep += " ---: | ---: | ---: | ---: |"
    print(head)
    print(sep)
    for c in levels:
        s = table[("specee", c)]
        s1 = table[("specee", levels[0])]["tok_s"]
        spread = lambda t: (f"{t['tok_s']:.1f} ({min(t['runs']):.0f}–{max(t['runs']):.0f})" if t["runs"] else "—") + \
            (f" [{t['stalled']} round(s) stalled]" if t["stalled"] else "")
        mean = lambda k: statistics.mean(x[k] for x in s["shape"])
        shape = (f"{mean(0):.1f} / {mean(1):.1f} | {mean(2):.1f} ({100 * mean(3):.0f}%)" if s["shape"] else "— | —")
        row = (f"| {c} | {spread(s)} | {s['tok_s'] / s1:.2f}× | {pct(s['ttft'], .5):.0f} / {pct(s['ttft'], .99):.0f} "
               f"| {pct(s['itl'], .5):.1f} / {pct(s['itl'], .99):.1f} | {shape} |")
        if a.llama_server and ("llama-server", c) not in table:
            row += " not run | | | |"
        elif a.llama_server:
            l = table[("llama-server", c)]
            l1 = table[("llama-server", llama_levels[0])]["tok_s"]
            row += (f" {spread(l)} | {l['tok_s'] / l1:.2f}× | {pct(l['itl'], .5):.1f} / {pct(l['itl'], .99):.1f} "
                    f"| {s['tok_s'] / l['tok_s']:.2f}× |")
        print(row)
    print(f"\n`bench/serve_bench.py {' '.join(sys.argv[1:])}`")


def long_document(words):
    """A long, varied text from the repository's own docs (deterministic)."""
    text = []
    for name in ["README.md", "docs/server.md", "heads/README.md", "bench/README.md"]:
        p = os.path.join(ROOT, name)
        if os.path.exists(p):
            with open(p) as f:
                text.extend(f.read().split())
    return " ".join(text[:words])


def prefix(a, model):
    rows = []
    for cache in [0, None]:
        server = specee_server(a, model, a.prefix_parallel, prefix_cache=cache)
        try:
            client = server.client()
            one_request(client, "User: Hello\nAssistant:" if a.plain else [{"role": "user", "content": "Hello"}], 4)
            ttfts = []
            for r in range(a.repeat):
                doc = long_document(900 + 40 * r)
                question = f"Read this text:\n\n{doc}\n\nWhat is it about, in one sentence?"
                if a.plain:
                    # A model without a chat template: the conversation as raw text (completions).
                    turn1 = f"User: {question}\nAssistant:"
                    answer = client.completions.create(model="m", prompt=turn1, max_tokens=32, temperature=0)
                    turn2 = f"{turn1}{answer.choices[0].text}\nUser: Name one command it mentions.\nAssistant:"
                else:
                    turn1 = [{"role": "user", "content": question}]
                    answer = client.chat.completions.create(model="m", messages=turn1, max_tokens=32, temperature=0)
                    turn2 = turn1 + [{"role": "assistant", "content": answer.choices[0].message.content},
                                     {"role": "user", "content": "Name one command it mentions."}]
                prompt_tokens = answer.usage.prompt_tokens
                _, ttft, _ = one_request(client, turn2, 8)
                ttfts.append(ttft)
            rows.append((cache, prompt_tokens, statistics.median(ttfts), min(ttfts), max(ttfts)))
        finally:
            server.stop()
    (_, p, off, off_lo, off_hi), (_, _, on, on_lo, on_hi) = rows
    print(f"\n{os.path.basename(model)}, {a.threads} thread(s), --parallel {a.prefix_parallel}; second chat turn resending a first turn of ~{p} "
          f"prompt tokens, median of {a.repeat} (min–max)\n")
    print("| prefix cache | second-turn TTFT ms |")
    print("| --- | ---: |")
    print(f"| off (`--prefix-cache 0`) | {off * 1000:.0f} ({off_lo * 1000:.0f}–{off_hi * 1000:.0f}) |")
    print(f"| on (default) | {on * 1000:.0f} ({on_lo * 1000:.0f}–{on_hi * 1000:.0f}) |")
    print(f"\nspeed-up of the time to first token: {off / on:.1f}×")
    print(f"\n`bench/serve_bench.py {' '.join(sys.argv[1:])}`")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2", help="smollm2, gemma3, qwen-coder or a GGUF path")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default 4 × clients, >= 16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every level (median reported)")
    ap.add_argument("--ctx", type=int, default=2048, help="context per request / slot")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "bench/chat-heldout.jsonl"))
    ap.add_argument("--llama-server", action="store_true", help="also measure llama.cpp's llama-server")
    ap.add_argument("--llama-server-path", default=None)
    ap.add_argument("--llama-clients", default=None,
                    help="llama-server's concurrency levels (default: --clients); 0.3.36 stalled at 16 streaming "
                         "clients on this machine (no progress for minutes, idle, in two runs)")
    ap.add_argument("--prefix", action="store_true", help="measure the prefix cache on a second chat turn")
    ap.add_argument("--plain", action="store_true",
                    help="--prefix through completions with `User:`/`Assistant:` text (models without a chat template)")
    ap.add_argument("--prefix-parallel", type=int, default=2,
                    help="--prefix: the server's --parallel (1: the single worker keeping its last request's cache)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--specee", default=os.path.join(ROOT, "target/release/specee"))
    ap.add_argument("--serve-args", default="", help="more options of `specee serve`, e.g. \"--tree-rows 1\"")
    a = ap.parse_args()
    model = a.model
    if model in MODELS:
        model = os.path.join(ROOT, "models", MODELS[model])
    if not os.path.exists(model):
        raise SystemExit(f"{model} not found (run `specee generate -m {a.model}` once to fetch a default model)")
    if a.prefix:
        prefix(a, model)
    else:
        throughput(a, model, load_prompts(a.prompts))


if __name__ == "__main__":
    main()
