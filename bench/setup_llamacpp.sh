#!/usr/bin/env bash
# Builds llama-cpp-python from its sdist for bench/vs_llamacpp.py.
#
# Why from source with explicit ISA flags: the prebuilt/native builds have crashed on CPUs with
# AMX here, so GGML_NATIVE is off and the SIMD levels are named one by one, AVX-512 only where
# this CPU reports it (read from /proc/cpuinfo). The build takes ~10 minutes on 2 cores.
#
# Usage: bash bench/setup_llamacpp.sh [TARGET_DIR]
#   PYTHON (default: python) is the interpreter whose pip builds it; with TARGET_DIR the package
#   goes there (pip --target) instead of into that interpreter's environment; put TARGET_DIR on
#   PYTHONPATH when running the bench then (--no-deps there, so the target never shadows the
#   environment's numpy: llama_cpp's other needs, numpy, jinja2 and typing-extensions, come
#   with torch; diskcache, pure Python, is put into TARGET_DIR beside it).
set -euo pipefail
PYTHON="${PYTHON:-python}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
has() { [[ " $flags " == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
args+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"
if has avx512f && has avx512bw && has avx512vl; then
  args+=" -DGGML_AVX512=ON"
  has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
  has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"
  has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
fi
# AMX stays off by default (the crash above); LLAMACPP_AMX=1 turns it on where the CPU has it
# (llama.cpp's AMX kernels for Q4_0 / Q4_1 / Q8_0 and others: the peer a user of an AMX Xeon
# would build natively). Tried on 2026-12-05 (0.3.36, a 2-core Xeon with AMX): it repacks the
# weights for AMX, then the first matmul dies with SIGILL at `tilezero` in
# ggml_backend_amx_mul_mat (gdb), with or without the process holding the tile permission, so
# the benches' peer stays the build without AMX.
if [[ "${LLAMACPP_AMX:-0}" == 1 ]] && has amx_tile && has amx_int8; then
  args+=" -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON"
  has amx_bf16 && args+=" -DGGML_AMX_BF16=ON"
fi
echo "CMAKE_ARGS=$args"
target=()
if [[ $# -ge 1 ]]; then target=(--target "$1" --no-deps); fi
CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  "$PYTHON" -m pip install --no-cache-dir --no-binary llama-cpp-python \
  "${target[@]}" "llama-cpp-python==$VERSION"
if [[ $# -ge 1 ]]; then
  "$PYTHON" -m pip install --no-cache-dir --target "$1" --no-deps diskcache
fi
