#!/usr/bin/env bash
# Sets up the venv and runs the whole test suite (GPU tests skip without a GPU; without one the
# Triton kernel tests then run again on Triton's CPU interpreter).
# Extra arguments go to pytest, e.g. scripts/test.sh -k speculative
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh" "test,serve,onnx,kernels-cpu,cxx"
cd "$ROOT"
# Two workers (pytest-xdist): each test file runs on one worker, so its module's engines are built once, and the
# session's shared engines (the aoti engine, the C++ library) are built once in the run by whichever worker
# asks first (tests/conftest.py, once_per_run). TEST_WORKERS=0: one process.
workers=()
"$PY" -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-2}" != 0 ] && workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
"$PY" -m pytest -ra "${workers[@]}" "$@"
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    # No GPU: the Triton kernels' tests once more, on Triton's CPU interpreter (small sizes;
    # correct, not fast). With a GPU the run above has compiled and run them.
    echo "[test] tests/kernels/ on Triton's CPU interpreter (TRITON_INTERPRET=1)" >&2
    rc=0
    # (Triton 3.6's interpreter converts 1-element arrays with int(): one numpy warning per call.) The
    # interpreter runs each test in one process's Python, so a worker per core (pytest-xdist) divides the
    # time: 6.5 minutes instead of 13 on two cores.
    workers=()
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n auto)
    TRITON_INTERPRET=1 "$PY" -m pytest -ra -W "ignore::DeprecationWarning:triton.runtime.interpreter" "${workers[@]}" \
        "$@" tests/kernels || rc=$?
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"  # 5: arguments that select none of its tests
fi
