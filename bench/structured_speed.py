"""Speed of grammar-constrained decoding (issue #37): for N schema/prompt pairs (the family of
crates/cli/tests/server/structured_output.py), runs `specee generate --json` side by side:

  free       unconstrained dense greedy, as many tokens as the constrained answer (--ignore-eos), same prompt
  off        --json-schema, --mode dense --jump-forward off (one forward per token)
  checked    --json-schema, --mode dense (jump-forward checked, the default: its ids must equal off's)
  unchecked  --json-schema, --mode dense --jump-forward unchecked (its ids may differ from off's: the number of
             identical answers is printed)
  eagle      --json-schema, --mode eagle (its ids must equal off's)

With --exit-modes also the early-exit modes (lossy; SmolLM2 and Gemma ship predictors):

  specee, specee-eagle            --json-schema, --mode specee / specee-eagle (answers must parse)
  specee-free, specee-eagle-free  the same mode unconstrained, as many tokens (--ignore-eos)

with, per early-exit mode, the answers identical to constrained dense's, the exit rate and layers per forward.

and prints per mode the decode speed over all pairs (total tokens / total decode seconds; median and range over
--repeat alternating rounds), τ for eagle, and the ratios constrained/free.

    python3 bench/structured_speed.py -m smollm2 [-m qwen-coder] [--cases 12] [--repeat 3] [--exit-modes]
                                      [--bin target/release/specee]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "crates", "cli", "tests", "server"))
from structured_output import cases  # noqa: E402


def run(binary, model, prompt, extra, threads):
    args = [binary, "generate", "-m", model, "-p", prompt, "--chat", "-t", str(threads), "--json"] + extra
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--bin", default="target/release/specee")
    ap.add_argument("--exit-modes", action="store_true", help="also specee and specee-eagle, under the schema and free")
    a = ap.parse_args()
    exit_modes = ["specee", "specee-eagle"] if a.exit_modes else []
    print("| model | mode | tok/s median (min–max) | ×free | τ | tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model in a.model or ["smollm2"]:
        rates = {"free": [], "off": [], "checked": [], "unchecked": [], "eagle": []}
        for m in exit_modes:
            rates[m], rates[m + "-free"] = [], []
        exits = {m: {"same": 0, "exit_rate": [], "layers": []} for m in exit_modes}
        taus, tokens = [], 0
        same = forced = jump_tokens = 0
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.repeat):
                totals = {k: [0, 0.0] for k in rates}
                fwd = [0, 0]
                tokens = same = forced = jump_tokens = 0
                for i, (name, schema, prompt) in enumerate(cases(a.cases)):
                    path = os.path.join(tmp, f"{i}.json")
                    with open(path, "w") as f:
                        json.dump(schema, f)
                    s = ["--json-schema", path, "-n", str(a.n)]
                    d = run(a.bin, model, prompt, s + ["--mode", "dense", "--jump-forward", "off"], a.threads)
                    c = run(a.bin, model, prompt, s + ["--mode", "dense"], a.threads)
                    e = run(a.bin, model, prompt, s + ["--mode", "eagle"], a.threads)
                    j = run(a.bin, model, prompt, s + ["--mode", "dense", "--jump-forward", "unchecked"], a.threads)
                    for other, label in [(c, "checked jump-forward"), (e, "eagle")]:
                        if other["generated_ids"] != d["generated_ids"]:
                            sys.exit(f"{model} {name}: {label}'s constrained output differs from dense's")
                    json.loads(j["text"])
                    same += j["generated_ids"] == d["generated_ids"]
                    forced += c["timings"]["forced_tokens"]
                    jump_tokens += len(c["generated_ids"])
                    n = len(d["generated_ids"])
                    tokens += n
                    free = run(a.bin, model, prompt, ["--mode", "dense", "-n", str(n), "--ignore-eos"], a.threads)
                    runs = [("free", free), ("off", d), ("checked", c), ("unchecked", j), ("eagle", e)]
                    for m in exit_modes:
                        g = run(a.bin, model, prompt, s + ["--mode", m], a.threads)
                        json.loads(g["text"])
                        k = len(g["generated_ids"])
                        f = run(a.bin, model, prompt, ["--mode", m, "-n", str(k), "--ignore-eos"], a.threads)
                        runs += [(m, g), (m + "-free", f)]
                        if r == 0:
                            exits[m]["same"] += g["generated_ids"] == d["generated_ids"]
                            exits[m]["exit_rate"].append(g["early_exit"]["exit_rate"])
                            exits[m]["layers"].append(g["early_exit"]["avg_layers"])
                    for k, g in runs:
                        t = g["timings"]
                        totals[k][0] += t["decode_tokens"]
                        totals[k][1] += t["decode_tokens"] / t["decode_tokens_per_s"] if t["decode_tokens_per_s"] else 0
                    fwd[0] += e["speculative"]["target_forwards"]
                    fwd[1] += len(e["generated_ids"])
                for k in rates:
                    rates[k].append(totals[k][0] / totals[k][1])
                taus.append(fwd[1] / fwd[0])
        free = statistics.median(rates["free"])
        for k in rates:
            med = statistics.median(rates[k])
            tau = f"{statistics.median(taus):.2f}" if k == "eagle" else ""
            print(f"| {model} | {k} | {med:.1f} ({min(rates[k]):.1f}–{max(rates[k]):.1f}) | {med / free:.2f} | {tau} | {tokens} |", flush=True)
        n = len(cases(a.cases))
        for m in exit_modes:
            x = exits[m]
            ratio = statistics.median(rates[m]) / statistics.median(rates[m + "-free"])
            print(f"{m} on {model}: constrained / unconstrained {ratio:.2f}; {x['same']} of {n} answers identical "
                  f"to constrained dense; exit rate {statistics.mean(x['exit_rate']):.2f}, layers per forward "
                  f"{statistics.mean(x['layers']):.1f} (means over answers)", flush=True)
        print(f"checked jump-forward on {model}: {forced} of {jump_tokens} tokens fed as forced rows "
              f"({forced / max(jump_tokens, 1):.0%}); unchecked made {same} of {n} answers as dense", flush=True)


if __name__ == "__main__":
    main()
