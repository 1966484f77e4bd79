"""Process helpers the servers and the tensor-parallel ranks share (the standard library only)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it dies (no rank or server child
    outlives it). Safe between fork and exec (``preexec_fn``); elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (ImportError, OSError, AttributeError):
        pass
