#!/usr/bin/env bash
# Sets up the venv and runs the whole test suite (GPU tests skip without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k speculative
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh" "test,serve,onnx"
cd "$ROOT"
exec "$PY" -m pytest -ra "$@"
