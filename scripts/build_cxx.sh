#!/usr/bin/env bash
# Builds the C++ embedding (cxx/: the library libmuse_spark_embed.so, its header, and the example
# program muse_spark_generate) against the torch of the project's venv, into build/cxx (or $1).
# docs/cxx.md says how to use it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh" "cxx"
OUT="${1:-$ROOT/build/cxx}"
echo "[cxx] configuring $OUT (torch from $PY)" >&2
"$VENV/bin/cmake" -S "$ROOT/cxx" -B "$OUT" -DPython3_EXECUTABLE="$PY" >&2
echo "[cxx] compiling" >&2
"$VENV/bin/cmake" --build "$OUT" -j "$(nproc)" >&2
echo "[cxx] built $OUT/muse_spark_generate and $OUT/libmuse_spark_embed.so" >&2
