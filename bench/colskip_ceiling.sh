#!/usr/bin/env bash
# Column-skipping products (crates/kernels/src/colskip.rs) against the dense kernels, one activation row, at 0 / 30 /
# 50 / 70 / 90% zero inputs: what activation sparsity's kernels can deliver on this CPU (issue #39 item 2).
# Three regimes: SmolLM2's down projection (576 x 1536) cycling through 32 MB of copies (L3, as SmolLM2's 96 MB per
# token are here), Qwen2.5-Coder's (896 x 4864) through 800 MB (memory), and one copy on one thread (L2: compute).
# Dense and column runs alternate; each line is the median of REPS runs (min-max). Weights are Q4_1 (random bits).
# 576 rows run the i16 kernels, 896 the VNNI one on AVX-512 VNNI machines (SPECEE_COLSKIP_I16=1: the i16 one).
# Usage: bench/colskip_ceiling.sh [REPS=3] [THREADS=2]; run nothing else CPU-heavy meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}
threads=${2:-2}
cargo build --release --quiet -p kernels --example colskip_probe
probe=./target/release/examples/colskip_probe
run() { # rows cols zero threads iters mode megabytes -> microseconds
  "$probe" "$1" "$2" "$3" "$4" "$5" "$6" "$7" | sed -E 's/.*: +([0-9.]+) us.*/\1/'
}
stats() { sort -g | awk '{v[NR]=$1} END {printf "%8.1f us (%.1f-%.1f)", v[int((NR+1)/2)], v[1], v[NR]}'; }
for regime in "576 1536 $threads 20000 32 L3" "896 4864 $threads 400 800 memory" "896 4864 1 2000 0 L2-one-thread"; do
  set -- $regime
  rows=$1 cols=$2 t=$3 iters=$4 mb=$5 name=$6
  echo "== ${rows}x${cols}, $t thread(s), $name"
  dense=$(for _ in $(seq "$reps"); do run "$rows" "$cols" 0 "$t" "$iters" dense "$mb"; done | stats)
  echo "dense          $dense"
  for z in 0 30 50 70 90; do
    col=$(for _ in $(seq "$reps"); do run "$rows" "$cols" "$z" "$t" "$iters" col "$mb"; done | stats)
    echo "column ${z}% zero $col"
  done
done
