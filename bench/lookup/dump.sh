#!/usr/bin/env bash
# bench/lookup/dump.sh PROMPTS.jsonl OUT.jsonl: Qwen2.5-Coder's dense greedy answer (128 tokens) to each chat prompt
# of PROMPTS, one {"p": prompt ids, "g": generated ids} line each, for sim.py and policy.py. Run from the checkout.
set -euo pipefail
in=$1; out=$2; : > "$out"
msg=$(mktemp); trap 'rm -f "$msg"' EXIT
while IFS= read -r line; do
  printf '%s' "$line" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["messages"]))' > "$msg"
  ./target/release/specee generate -m qwen-coder --messages "$msg" -n 128 -t 2 --mode dense --json 2>/dev/null \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"p": d["prompt_ids"], "g": d["generated_ids"]}))' >> "$out"
done < "$in"
