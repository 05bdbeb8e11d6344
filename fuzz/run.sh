#!/usr/bin/env bash
# Builds the fuzz targets with coverage instrumentation (stable toolchain: libFuzzer from the libfuzzer-sys
# crate, LLVM SanitizerCoverage through stable `-C` flags) and runs each for a while, then prints one row per
# target: executions, coverage (edges), corpus size, crashes. See fuzz/README.md.
#
#   fuzz/run.sh [--seconds S | --runs N] [TARGET…]     (default: 60 s per target, every target)
#
# The corpus grows in fuzz/corpus/<target>/ (git-ignored; fuzz/seeds/<target>/ is read as a second, committed
# corpus), crashes land in fuzz/artifacts/<target>/. Exit status 1 when any target crashed, hung or ran out of
# memory, 2 on a usage or build error.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=60 runs="" targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) echo "fuzz/run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all=(gguf_file tokenizer_vocab tokenizer_text chat_template head_files pytorch_head server_request jsonl_files)
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "fuzz/run.sh: no target $t (targets: ${all[*]})" >&2; exit 2; }
done

host=$(rustc -vV | sed -n 's/^host: //p')
# --target: the flags then apply to the targets only, not to build scripts and proc macros.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares"
(cd fuzz && cargo build --release --locked --target "$host" --bins) || exit 2
bin="fuzz/target/$host/release"

# Per-target options: dictionaries, and larger inputs where seeds are whole (tiny) models.
opts_for() {
  case "$1" in
    gguf_file) echo "-dict=fuzz/dict/gguf.dict -max_len=200000" ;;
    tokenizer_vocab) echo "-max_len=8192" ;;
    chat_template) echo "-dict=fuzz/dict/jinja.dict -max_len=8192" ;;
    head_files) echo "-dict=fuzz/dict/json.dict -max_len=16384" ;;
    server_request|jsonl_files) echo "-dict=fuzz/dict/json.dict" ;;
    *) echo "" ;;
  esac
}

printf '%-16s %12s %9s %8s %8s %8s %7s\n' target executions exec/s cov features corpus crashes
failed=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t" "fuzz/seeds/$t"
  log="fuzz/artifacts/$t/last-run.log"
  limit=$([ -n "$runs" ] && echo "-runs=$runs" || echo "-max_total_time=$seconds")
  before=$(find "fuzz/artifacts/$t" -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' | wc -l)
  start=$(date +%s%N)
  # -timeout: one input running 10 s is a hang; -rss_limit_mb: a parse growing past 2 GB is unbounded.
  # shellcheck disable=SC2046
  "$bin/$t" "fuzz/corpus/$t" "fuzz/seeds/$t" $limit -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="fuzz/artifacts/$t/" $(opts_for "$t") >"$log" 2>&1 || true
  elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
  after=$(find "fuzz/artifacts/$t" -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' | wc -l)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(echo "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
  ft=$(echo "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
  corp=$(echo "$last" | sed -n 's/.*corp: \([0-9]*\).*/\1/p')
  rate=$(( ${execs:-0} * 1000 / (elapsed_ms > 0 ? elapsed_ms : 1) ))
  new=$((after - before))
  printf '%-16s %12s %9s %8s %8s %8s %7s\n' "$t" "${execs:-?}" "$rate" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$new"
  if [ "$new" -gt 0 ] || grep -qE '^==[0-9]+== ERROR|panicked at|deadly signal' "$log"; then
    failed=1
    echo "  $t: see $log and fuzz/artifacts/$t/ (reproduce: $bin/$t FILE)" >&2
    grep -m3 -E 'panicked at|ERROR: libFuzzer' "$log" | sed 's/^/  /' >&2 || true
  fi
done
exit "$failed"
