#!/usr/bin/env bash
# The SpecEE table of issue #5: every KV policy × verification variant on one model — decode speed against dense
# (`specee bench --prompts`, same run), teacher-forced agreement / perplexity / layers (`specee eval --text`).
#
#   scripts/specee_table.sh MODEL.gguf PROMPTS.jsonl [N_GEN=64] [CHUNKS=8] [THREADS=2]
#
# SPECEE_MODE=specee-eagle measures early exit inside eagle's tree verification instead (then "layers" are per
# tree forward).
#
# Prints one markdown row per variant. The text is ../shared/reference/perplexity-text.txt (held out: never used
# for training draft heads or predictors).
set -euo pipefail
model=$1 prompts=$2 n=${3:-64} chunks=${4:-8} threads=${5:-2}
bin=${SPECEE_BIN:-target/release/specee}
mode=${SPECEE_MODE:-specee}
text=../shared/reference/perplexity-text.txt
echo "| KV policy | verification | dense tok/s | $mode tok/s | speed-up | free-running matching prefix | agreement | PPL dense → mode | layers | predictor calls/token | failed verifications/token |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for policy in deferred missing propagate; do
  for verify in candidates full; do
    b=$("$bin" bench -m "$model" --mode "$mode" --kv-policy "$policy" --verify "$verify" --prompts "$prompts" -n "$n" -t "$threads" --json 2>/dev/null)
    e=$("$bin" eval -m "$model" --mode "$mode" --kv-policy "$policy" --verify "$verify" --text "$text" --chunks "$chunks" -t "$threads" --json 2>/dev/null)
    python3 - "$policy" "$verify" "$b" "$e" <<'PY'
import json, sys
policy, verify, b, e = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
print(f"| {policy} | {verify} | {b['dense_decode_tokens_per_s']:.1f} | {b['decode_tokens_per_s']:.1f} | "
      f"{b['speedup_vs_dense']:.2f}× | {b['mean_matching_prefix']:.1f} / {b['n_gen']} | {e['agreement']:.4f} | "
      f"{e['ppl_dense']:.2f} → {e['ppl_mode']:.2f} | {e['avg_layers']:.2f} / {e['n_layers']} | "
      f"{e['predictor_calls_per_token']:.2f} | {e['verify_failures_per_token']:.3f} |")
PY
  done
done
