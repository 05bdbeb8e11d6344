#!/usr/bin/env python3
"""llama.cpp side of `specee bench --prompts FILE --llama-cpp`: decode speed on the same prompts, from llama-server.

Starts llama.cpp's own `llama-server` (built by scripts/build_llama_cpp.sh) on a free local port with the given
model and threads, one slot, sends every prompt as token ids (the caller's, so both engines see the same input;
chat prompts arrive already rendered) to `/completion` with greedy sampling and `n_predict` N, and reads the
server's own timings of the generated tokens (`predicted_n`, `predicted_ms`: decoding only, no HTTP or prompt
time). One warm-up request first. Prints one JSON object: {"per_prompt": [{"tokens", "decode_ms", "ids"}],
"decode_tokens_per_s": total tokens / total decode seconds}.

Usage: llama_server_bench.py --server PATH --model GGUF --threads T --n N --ctx C < PROMPTS
       (PROMPTS: one line of comma-separated token ids per prompt)
"""
import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(port, proc, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n", type=int, required=True, help="tokens to generate per prompt")
    ap.add_argument("--ctx", type=int, required=True)
    a = ap.parse_args()
    prompts = [[int(x) for x in line.split(",") if x] for line in sys.stdin if line.strip()]
    port = free_port()
    cmd = [a.server, "-m", a.model, "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.ctx), "-np", "1",
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if not wait_ready(port, proc):
            err = proc.stderr.read().decode(errors="replace").strip().splitlines() if proc.poll() is not None else []
            print(f"llama-server did not start: {err[-1] if err else 'no answer on /health'}", file=sys.stderr)
            sys.exit(1)
        body = {"n_predict": a.n, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "stream": False}
        post(port, {**body, "prompt": prompts[0] if prompts else [1], "n_predict": 8})
        rows = []
        for ids in prompts:
            r = post(port, {**body, "prompt": ids, "return_tokens": True})
            t = r.get("timings", {})
            rows.append({"tokens": t.get("predicted_n", 0), "decode_ms": t.get("predicted_ms", 0.0),
                         "ids": r.get("tokens", [])})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["decode_ms"] for r in rows) / 1000
    print(json.dumps({"per_prompt": rows, "decode_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}))


if __name__ == "__main__":
    main()
