#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the project.
# CPU torch first (pip takes 2.13.0 from the local disk on these machines), then the
# project, so that pip never resolves a multi-GB CUDA build of torch.
# Usage: source scripts/setup_venv.sh [extras]     (sets $VENV and $PY)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MUSE_SPARK_VENV:-$ROOT/.venv}"
EXTRAS="${1:-test}"
PYTHON_BIN="$(command -v python3.11 || command -v python3)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch==2.13.0 (CPU)" >&2
    "$PY" -m pip install -q "torch==2.13.0"
fi
echo "[setup] installing muse-spark[$EXTRAS]" >&2
"$PY" -m pip install -q -e "$ROOT[$EXTRAS]"
export VENV PY
