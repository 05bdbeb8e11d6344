#!/usr/bin/env bash
# Builds llama.cpp's own C++ tools once, from the source archive of the `llama-cpp-python` package (the same code
# our Python-binding baseline runs), and prints where they are. The side-by-side baseline for every speed figure:
# `llama-bench` (prompt and decode speed), `llama-perplexity`, `llama-server`, `llama-simple`.
#
# Usage: scripts/build_llama_cpp.sh            builds (or finds) the tools; prints KEY=PATH lines on stdout
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the package version whose archive is built (default below; the one installed here)
#   LLAMA_CPP_DIR             where archive, sources and build live (default: vendor/ of the checkout, git-ignored)
#   LLAMA_CPP_ARCHIVE         a source archive already at hand (else it is fetched with `pip download` by name)
#   LLAMA_CPP_JOBS            parallel compile jobs (default: the number of CPUs)
#
# The build is native (`-march=native`), like `pip install llama-cpp-python` built from source; on a CPU with AMX it
# names the CPU's extensions one by one instead, AMX left out (natively built, llama-bench and the package died of
# SIGILL in ggml's AMX path on such a CPU, see the README). Nothing is
# downloaded at build time: the web UI's prebuilt download and HTTPS are off.
#
# Exit status: 0 built or found; 2 a prerequisite is missing (compiler, cmake, the archive), with one line saying
# which and how to get it; other codes are the build's own failures.
set -euo pipefail

version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${LLAMA_CPP_DIR:-$root/vendor}
src=$dir/llama.cpp-$version
build=$src/build
tools=(llama-bench llama-perplexity llama-server llama-simple)

die() { echo "build_llama_cpp: $*" >&2; exit 2; }

print_paths() {
  echo "LLAMA_CPP_VERSION=$version"
  for t in "${tools[@]}"; do
    key=$(echo "$t" | tr 'a-z-' 'A-Z_')
    echo "$key=$build/bin/$t"
  done
}

all_built=1
for t in "${tools[@]}"; do [ -x "$build/bin/$t" ] || all_built=0; done
if [ "$all_built" = 1 ]; then
  print_paths
  exit 0
fi

command -v c++ >/dev/null || command -v g++ >/dev/null ||
  die "no C++ compiler on PATH (install one: apt-get install g++)"
command -v cmake >/dev/null ||
  die "cmake is not on PATH (install it: apt-get install cmake, or python3 -m pip install cmake)"

mkdir -p "$dir"
archive=${LLAMA_CPP_ARCHIVE:-$dir/llama_cpp_python-$version.tar.gz}
if [ ! -f "$archive" ]; then
  if [ -n "${LLAMA_CPP_ARCHIVE:-}" ]; then
    die "source archive $archive does not exist (unset LLAMA_CPP_ARCHIVE to fetch llama-cpp-python $version by name)"
  fi
  echo "build_llama_cpp: fetching the llama-cpp-python $version source archive (pip download)" >&2
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$dir" >&2 ||
    die "could not fetch the llama-cpp-python $version source archive with pip (no registry access?); \
put it at $archive or name it with LLAMA_CPP_ARCHIVE"
  [ -f "$archive" ] || die "pip did not leave $archive"
fi

if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "build_llama_cpp: unpacking llama.cpp from $(basename "$archive")" >&2
  rm -rf "$src.tmp" && mkdir -p "$src.tmp"
  tar xzf "$archive" -C "$src.tmp" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp" || {
    rm -rf "$src.tmp"
    die "$archive has no llama_cpp_python-$version/vendor/llama.cpp (not a llama-cpp-python $version source archive?)"
  }
  rm -rf "$src" && mv "$src.tmp" "$src"
fi

flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF)
if grep -q -w amx_tile /proc/cpuinfo 2>/dev/null; then
  # `-march=native` turns AMX on whatever the GGML_AMX_* options say, and llama-bench built so died of SIGILL at
  # its first AMX `tilezero` on this project's AMX VM (session 58). So: not native, every other extension the CPU
  # has named one by one, AMX off.
  flags=("${flags[@]/-DGGML_NATIVE=ON/-DGGML_NATIVE=OFF}")
  has() { grep -q -w "$1" /proc/cpuinfo; }
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has "${pair%%:*}"; then flags+=("-DGGML_${pair#*:}=ON"); else flags+=("-DGGML_${pair#*:}=OFF"); fi
  done
  flags+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
echo "build_llama_cpp: building ${tools[*]} in $build (a few minutes)" >&2
cmake -S "$src" -B "$build" "${flags[@]}" >"$dir/cmake-configure.log" 2>&1 || {
  tail -20 "$dir/cmake-configure.log" >&2
  exit 1
}
cmake --build "$build" --target "${tools[@]}" -j "${LLAMA_CPP_JOBS:-$(nproc)}" >"$dir/cmake-build.log" 2>&1 || {
  tail -30 "$dir/cmake-build.log" >&2
  exit 1
}
print_paths
