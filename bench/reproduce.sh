#!/usr/bin/env bash
# Regenerates every speed table the README shows, each measured side by side with llama.cpp's own tools in the
# same command: dense prompt and decode speed against `llama-bench`, and each decoding mode against our dense and
# `llama-server` on the same held-out prompts, for the three default models at 2 and 1 threads. Prints markdown:
# the machine, then every table with the command that made it under it (README's "Speed" section is this output).
#
# Usage: bench/reproduce.sh [> docs/speed.md]      (~40 min on a quiet 2-core machine; nothing else may run)
#   SPECEE_REPRO_THREADS="2 1"   thread counts (default both)
#   SPECEE_REPRO_MODELS="smollm2 gemma3 qwen-coder"
#   SPECEE_REPRO_QUICK=1         a smoke run: 2 prompts, 16 tokens, 1 repetition (figures meaningless)
# Models are fetched if missing; llama.cpp's tools are built once by scripts/build_llama_cpp.sh (~11 min).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${SPECEE_REPRO_THREADS:-"2 1"}
models=${SPECEE_REPRO_MODELS:-"smollm2 gemma3 qwen-coder"}
n=128 reps=3 limit=""
if [ -n "${SPECEE_REPRO_QUICK:-}" ]; then n=16 reps=1 limit=2; fi
cargo build --release -q
bin=target/release/specee
bash scripts/build_llama_cpp.sh > /dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

prompts() {  # prompts FILE: the file, or its first $limit lines in quick mode
  if [ -z "$limit" ]; then echo "$1"; else head -n "$limit" "$1" > "$tmp/$(basename "$1")"; echo "$tmp/$(basename "$1")"; fi
}

run() {  # run ARGS...: one table and the command under it
  local shown="specee ${*}"
  echo '```'
  "$bin" "$@" 2> "$tmp/err" | sed '/^$/d' || { echo "FAILED: $(tail -n 1 "$tmp/err")"; }
  echo '```'
  echo "\`${shown//$tmp\//bench/}\`"
  echo
}

echo "# Speed of specee against llama.cpp"
echo
echo "Made by \`bench/reproduce.sh\` on $(date -u +%Y-%m-%d) at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo ' (with local changes)')."
echo "Machine: $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB;"
echo "llama.cpp $(bash scripts/build_llama_cpp.sh | sed -n 's/^LLAMA_CPP_VERSION=//p') (from the llama-cpp-python source archive, built natively)."
[ -n "$limit" ] && echo && echo "**Smoke run (SPECEE_REPRO_QUICK): 2 prompts, $n tokens; the figures mean nothing.**"
echo
for t in $threads; do
  for m in $models; do
    echo "## $m, $t thread$([ "$t" = 1 ] || echo s)"
    echo
    run bench -m "$m" -t "$t" -p 128 -n "$n" -r "$reps" --llama-cpp
    case $m in
      smollm2) sets="chat-heldout"; modes="eagle specee specee-eagle" ;;
      gemma3) sets="plain-heldout"; modes="eagle specee specee-eagle" ;;
      qwen-coder) sets="code-heldout chat-heldout"; modes="eagle" ;;
      *) sets="chat-heldout"; modes="eagle" ;;
    esac
    for s in $sets; do
      for mode in $modes; do
        run bench -m "$m" -t "$t" --mode "$mode" --prompts "$(prompts "bench/$s.jsonl")" -n "$n" -r 1 --llama-cpp
      done
    done
  done
done
