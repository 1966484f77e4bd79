"""Keeps tritonserver serving: a graceful drain on shutdown, a restart when a model process dies.

``muse-spark serve`` runs tritonserver under this supervisor, behind the HTTP front (``front.py``):

* **Shutdown.** The first SIGINT/SIGTERM/SIGHUP makes the front refuse new requests, writes the grace
  period into the drain file the model watches (``model.py``), and forwards the signal. The model ends
  waiting requests at once and running ones after the grace period, each with a final response
  (finish reason ``shutdown``), so tritonserver finds nothing in flight, unloads the model and exits 0.
  A second signal is forwarded as it comes (tritonserver then stops without waiting).
* **A dead model process.** Triton's python backend runs each model instance in a stub process; if one
  dies (killed, out of memory, a crash in native code), tritonserver keeps answering ready while every
  request to the model fails and the requests it held never finish. The supervisor watches the stubs;
  when one disappears it marks the front not ready, ends the requests in flight through the front with an
  error, stops tritonserver (gRPC streams then get an error too) and starts it again. A server that
  keeps dying (``MAX_RESTARTS`` within ``RESTART_WINDOW_S``) is given up with exit status 1.
* **tritonserver itself dying** is handled the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from muse_spark.process import die_with_parent

POLL_S = 0.2
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
KILL_AFTER_S = 5.0  # a tritonserver stopped after its model process died gets this long before SIGKILL
STUB = "triton_python_backend_stub"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound now (checked before the model loads, not after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def stub_pids(parent: int) -> set[int]:
    """The live python-backend stub processes among ``parent``'s children."""
    out = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # pid (comm) state ppid …; comm may hold spaces and parentheses, so split after the last ')'.
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
            if int(ppid) != parent or state == b"Z":
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if STUB.encode() in f.read():
                    out.add(int(entry.name))
        except (OSError, ValueError):
            continue
    return out


class Supervisor:
    """Runs ``command`` (tritonserver, its HTTP on the front's upstream port) until it is asked to stop."""

    def __init__(self, command: list[str], env: dict, front, *, drain_file: Path, grace_s: float,
                 log: Callable[[str], None]):
        self.command, self.env, self.front = command, env, front
        self.drain_file, self.grace_s, self.log = drain_file, grace_s, log
        self.proc: subprocess.Popen | None = None
        self.signals = 0
        self.restarts: list[float] = []

    # ---- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals == 1:
            self.log(f"{signal.Signals(signum).name}: draining (running requests may go on for "
                     f"{self.grace_s:g} s), then stopping")
            self.front.set_ready(False, reason="the server is shutting down")
            tmp = self.drain_file.with_suffix(".tmp")
            tmp.write_text(f"{self.grace_s}\n")
            os.replace(tmp, self.drain_file)  # the model never reads a half-written file
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            while not self.signals:
                rc, why = self._run_once()
                if self.signals:
                    return rc
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    self.log(f"{why}; giving up after {MAX_RESTARTS} restarts within {RESTART_WINDOW_S:g} s")
                    return 1
                self.log(f"{why}; restarting tritonserver ({len(self.restarts)} of at most {MAX_RESTARTS} "
                         f"restarts within {RESTART_WINDOW_S:g} s)")
            return 0
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._kill()

    def _run_once(self) -> tuple[int, str]:
        """Start tritonserver and watch it → (exit status, why it ended)."""
        self.proc = subprocess.Popen(self.command, env=self.env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        if not self.signals:
            self.front.set_ready(True)
        seen: set[int] = set()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                rc = 128 - rc if rc < 0 else rc
                return rc, f"tritonserver exited with status {rc}"
            if not self.signals:
                live = stub_pids(self.proc.pid)
                gone = seen - live
                if gone:
                    why = f"the model process (pid {', '.join(map(str, sorted(gone)))}) died"
                    self.front.set_ready(False, reason=f"{why}; restarting the server")
                    self.front.fail_inflight(f"{why} while serving this request; retry it")
                    self._kill()
                    return 1, why
                seen |= live
            time.sleep(POLL_S)

    def _kill(self) -> None:
        """Stop tritonserver: SIGTERM, then SIGKILL after ``KILL_AFTER_S``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the stubs go with it
            proc.wait()
