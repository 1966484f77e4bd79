"""In-flight batching for the Triton model: one thread owns the ``Generator``.

Triton calls ``execute`` on its own threads. ``execute`` only *submits*
(prompt, params, sink) to an inbox and returns, and a single scheduler thread
drives the ``Generator`` (so its lock is never contended) and does everything
else:

    loop:
        take the inbox → Generator.add (a bad request fails its sink alone)
        drop requests whose client went away → Generator.cancel (frees the slot)
        Generator.step()  (admits waiting requests, one speculative step for all)
        hand each request's new tokens to its sink (a streamed response, or the
        single final response of a non-streamed request)

A sink whose ``off_thread`` attribute is true (the Triton model's) has its calls
(``deliver``, ``fail``) run on a second thread, the responder, in the order the scheduler
made them, with a snapshot of the request as it was: building and sending a response
(detokenizing, the Triton tensors, the IPC to the server) then overlaps the next step
instead of delaying it; whether its client went away (``cancelled()``, an IPC round trip
for the Triton model) is asked there too. A ``deliver`` that raises (the client is gone) or
a client that went away has its request cancelled by the scheduler at its next turn. Shutdown waits for the responder to send
everything it was given. Other sinks are called on the scheduler thread with the live
request (the OpenAI server's may end it at a stop string).

New requests join between steps; a finished or cancelled request leaves at
once and its slot goes to the next waiting one. Every request gets exactly one
final call on its sink — ``deliver(..., finished)`` or ``fail`` — whatever
happens (bad input, cancellation, engine error, shutdown): in decoupled mode a
request without its final response would hang its client and block shutdown.

Shutdown: ``drain(grace)`` stops taking requests (new ones and those still
waiting for a slot end at once), lets the running ones go on for ``grace``
seconds and then ends them; ``stop()`` ends everything left. A request ended so
gets a normal final response with the tokens it has and finish reason
``shutdown``.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from muse_spark.runtime.generator import Generator, Request, RequestError, SamplingParams

# How often the scheduler asks the sinks whether their client went away. Each
# question is an IPC round trip to the Triton process, so not every step.
CANCEL_POLL_SECONDS = 0.02


class Sink(Protocol):
    """Where one request's results go (``model.py`` wraps a Triton response sender)."""

    def deliver(self, req: Request, new_tokens: list[int]) -> None:
        """New tokens of ``req`` (``req.finished`` says whether this is the last call).
        May raise: the client is then treated as gone and the request cancelled."""

    def fail(self, message: str, kind: str) -> None:
        """The final, error answer. ``kind``: 'invalid' | 'unavailable' | 'cancelled' | 'internal'."""

    def cancelled(self) -> bool:
        """Whether the client cancelled the request or went away."""

    # off_thread: bool — optional; true: ``deliver`` and ``fail`` run on the responder thread (a snapshot of
    # the request), false or absent: on the scheduler thread


@dataclass
class Counters:
    """Totals since start (read by the metrics publisher; written by the scheduler thread)."""

    outcomes: dict[str, int] = field(default_factory=lambda: {"completed": 0, "rejected": 0, "cancelled": 0,
                                                             "failed": 0})
    generated_tokens: int = 0
    steps: int = 0  # per-request speculative steps, summed
    accepted_draft_tokens: int = 0
    verified_draft_tokens: int = 0  # drafts sent to the target (γ a step unless a confidence schedule sends fewer)


@dataclass(frozen=True)
class Occupancy:
    active: int
    waiting: int
    free_slots: int


class Responder:
    """The sinks' calls, run in order on a thread of their own (``Scheduler``'s docstring says why).
    ``deliver(sink, snapshot, new)``, ``fail(sink, message, kind)`` and ``poll(sinks)`` (their ``cancelled()``)
    queue; ``broken()`` → the requests to cancel since the last call (a ``deliver`` raised, a client went
    away); ``flush()`` waits until everything queued has run; ``close()`` flushes and ends the thread."""

    def __init__(self, log=print):
        self._log = log
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: list[tuple[int, str]] = []
        self._polling = False  # a poll is queued and has not run yet
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="muse-spark-responder", daemon=True)
        self._thread.start()

    def deliver(self, sink: Sink, req: Request, new_tokens: list[int]) -> None:
        self._queue.put((self._deliver, (sink, req, new_tokens)))

    def fail(self, sink: Sink, message: str, kind: str) -> None:
        self._queue.put((_safe_fail, (sink, message, kind)))

    def poll(self, sinks: list[tuple[int, Sink]]) -> None:
        """Ask each (request id, sink) whether its client went away, on this thread, after what is queued (not
        while an earlier poll still waits its turn: a responder behind does not pile them up)."""
        with self._lock:
            if self._polling:
                return
            self._polling = True
        self._queue.put((self._poll, (sinks,)))

    def broken(self) -> list[tuple[int, str]]:
        """(request id, why) of the requests to cancel: a ``deliver`` raised, or a polled client went away."""
        with self._lock:
            out, self._broken = self._broken, []
        return out

    def _poll(self, sinks: list[tuple[int, Sink]]) -> None:
        with self._lock:
            self._polling = False
        for rid, sink in sinks:
            try:
                gone = sink.cancelled()
            except Exception:
                gone = True
            if gone:
                with self._lock:
                    self._broken.append((rid, "the request was cancelled"))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every call queued before this one has run → whether it did within ``timeout``."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put((done.set, ()))
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _deliver(self, sink: Sink, req: Request, new_tokens: list[int]) -> None:
        try:
            sink.deliver(req, new_tokens)
        except Exception:  # the client is gone: the scheduler cancels the request (if it still runs)
            if not req.finished:
                with self._lock:
                    self._broken.append((req.id, "the response could not be sent"))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a sink's bug must not stop the responses of the others
                self._log(f"muse_spark responder: a response failed:\n{traceback.format_exc()}")


class Prefix(Sequence):
    """The first ``n`` items of a list that only grows (a request's output, steps, log-probabilities): what it
    held when the view was taken, in O(1), whatever is appended after. Slices copy only what they select."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop] if step == 1 else [self._items[k] for k in range(start, stop, step)]
        if not -self._n <= i < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[i % self._n]

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, Prefix)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Prefix({list(self)!r})"


def snapshot(req: Request) -> Request:
    """``req`` as it is now, for a sink on the responder thread while the scheduler steps it on: a shallow
    copy whose output, steps and log-probabilities are ``Prefix`` views of the lists the scheduler appends to
    (O(1) a step, not O(tokens so far)); its step totals (``Request.totals``) are immutable."""
    view = copy.copy(req)
    view.output, view.steps, view.logprobs = Prefix(req.output), Prefix(req.steps), Prefix(req.logprobs)
    return view


class Scheduler:
    def __init__(self, engine, *, max_queue: int = 256, on_change=None, log=print, prefix_cache_bytes: int = 0):
        cache = None
        if prefix_cache_bytes:  # (stored prompt prefixes: runtime/prefix_cache.py)
            from muse_spark.runtime.prefix_cache import PrefixCache

            cache = PrefixCache(engine, prefix_cache_bytes)
        self.gen = Generator(engine, prefix_cache=cache)
        self.gamma = engine.gamma
        self.max_queue = max_queue
        self.counters = Counters()
        self._on_change = on_change  # called (counters, occupancy) from the scheduler thread
        self._log = log
        self._cond = threading.Condition()
        self._inbox: deque[tuple[list[int] | None, SamplingParams | None, Sink]] = deque()
        self._live: dict[int, tuple[Request, Sink]] = {}
        self._stopping = False
        self._drain_deadline: float | None = None
        self._queued = 0  # requests taken from the inbox that may still wait for a slot (see submit)
        self._last_poll = 0.0
        self._occupancy = Occupancy(0, 0, len(self.gen.free_slots))
        self._responder = Responder(log)
        self._thread = threading.Thread(target=self._run, name="muse-spark-scheduler", daemon=True)

    # ---- called from Triton's threads -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        with self._cond:
            # Counted under the lock, with what the scheduler thread has taken but not yet admitted, so
            # no burst of submissions gets past max_queue.
            queued = len(self._inbox) + self._queued
            if self._stopping or self._drain_deadline is not None:
                self.counters.outcomes["cancelled"] += 1
                shutdown = True
            elif queued >= self.max_queue:
                self.counters.outcomes["rejected"] += 1
                shutdown = False
            else:
                self._inbox.append((prompt, params, sink))
                self._cond.notify()
                return
        if shutdown:
            _safe_end(sink, Request.ended(prompt, params, "shutdown"))
        else:
            _safe_fail(sink, f"the request queue is full ({queued} requests waiting); retry later", "unavailable")

    def reject(self, sink: Sink, message: str, kind: str = "invalid") -> None:
        """Answer a request that failed before it could be submitted (counted with the others)."""
        with self._cond:
            self.counters.outcomes["rejected" if kind == "invalid" else "failed"] += 1
            self._inbox.append((None, None, sink))  # wakes the loop so the metrics follow
            self._cond.notify()
        _safe_fail(sink, message, kind)

    def drain(self, grace: float) -> None:
        """Take no more requests; end those waiting for a slot now and the running ones after ``grace`` s."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + max(0.0, grace)
                self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """End everything still queued or running (finish reason ``shutdown``), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:  # never started (or already gone): answer what is left here
            self._close()

    @property
    def occupancy(self) -> Occupancy:
        return self._occupancy

    # ---- the scheduler thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self.gen.has_work() and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        break
                    incoming = list(self._inbox)
                    self._inbox.clear()
                    self._queued += sum(1 for prompt, _, _ in incoming if prompt is not None)
                    deadline = self._drain_deadline
                for prompt, params, sink in incoming:
                    if prompt is not None:  # (None, None, sink): an already answered rejection
                        self._add(prompt, params, sink)
                self._drop_cancelled()
                if deadline is not None:
                    self._drain(deadline)
                if self.gen.has_work():
                    self._step()
                self._publish()
        except BaseException:  # a bug here must not leave clients hanging
            self._log(f"muse_spark scheduler crashed:\n{traceback.format_exc()}")
            self._fail_all("the scheduler crashed (see the server log)", "internal")
        finally:
            self._close()

    def _close(self) -> None:
        with self._cond:
            self._stopping = True
            leftover = list(self._inbox)
            self._inbox.clear()
        for prompt, params, sink in leftover:
            if prompt is not None:
                self._count("cancelled")
                _safe_end(sink, Request.ended(prompt, params, "shutdown"))
        self._end_all("shutdown", waiting_only=False)
        self._responder.close()  # every response queued is sent before stop() returns
        self._publish()

    def _drain(self, deadline: float) -> None:
        """While draining: nobody waits for a slot; past the deadline nobody runs."""
        self._end_all("shutdown", waiting_only=time.monotonic() < deadline)

    def _end_all(self, reason: str, *, waiting_only: bool) -> None:
        """End live requests with a final response of finish reason ``reason`` (the tokens they have)."""
        for req, sink in list(self._live.values()):
            if waiting_only and req.slot >= 0:
                continue
            self.gen.cancel(req, reason)
            self._live.pop(req.id, None)
            self._count("cancelled")
            req.pending = []
            self._end(sink, req)

    def _add(self, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        try:
            req = self.gen.add(prompt, params)
        except RequestError as e:
            self._count("rejected")
            self._fail(sink, str(e), "invalid")
            return
        self._live[req.id] = (req, sink)

    def _drop_cancelled(self) -> None:
        for rid, message in self._responder.broken():  # a response could not be sent, or the client went away
            entry = self._live.get(rid)
            if entry is not None:
                self._cancel(*entry, message)
        now = time.monotonic()
        if now - self._last_poll < CANCEL_POLL_SECONDS:
            return
        self._last_poll = now
        off_thread = []
        for req, sink in list(self._live.values()):
            if getattr(sink, "off_thread", False):  # (asked on the responder thread: an IPC round trip each)
                off_thread.append((req.id, sink))
                continue
            try:
                gone = sink.cancelled()
            except Exception:
                gone = True
            if gone:
                self._cancel(req, sink, "the request was cancelled")
        if off_thread:
            self._responder.poll(off_thread)

    def _cancel(self, req: Request, sink: Sink, message: str) -> None:
        self.gen.cancel(req)  # frees its slot (or removes it from the waiting list)
        self._live.pop(req.id, None)
        self._count("cancelled")
        self._fail(sink, message, "cancelled")

    def _step(self) -> None:
        try:
            updated = self.gen.step()
        except Exception as e:  # engine failure: fail the requests in it, keep serving
            self._log(f"muse_spark engine step failed:\n{traceback.format_exc()}")
            self._fail_all(f"the engine failed: {type(e).__name__}: {e}", "internal")
            return
        for req in updated:
            entry = self._live.get(req.id)
            if entry is None:
                continue
            sink = entry[1]
            if req.finish_reason == "error":  # the engine failed on this request alone (e.g. its prefill)
                self._live.pop(req.id, None)
                self._count("failed")
                self._fail(sink, f"the engine failed on this request: {getattr(req, 'error', None)}", "internal")
                continue
            new, req.pending = req.pending, []
            if getattr(sink, "off_thread", False):
                self._responder.deliver(sink, snapshot(req), new)
            else:
                try:
                    sink.deliver(req, new)
                except Exception:  # the client is gone
                    if not req.finished:
                        self._cancel(req, sink, "the response could not be sent")
                        continue
            if req.finished:
                self._live.pop(req.id, None)
                self._account(req)

    def _end(self, sink: Sink, req: Request) -> None:
        """The final response of a request the server ended (its tokens so far, its finish reason)."""
        if getattr(sink, "off_thread", False):
            self._responder.deliver(sink, snapshot(req), [])
        else:
            _safe_end(sink, req)

    def _fail(self, sink: Sink, message: str, kind: str) -> None:
        if getattr(sink, "off_thread", False):
            self._responder.fail(sink, message, kind)
        else:
            _safe_fail(sink, message, kind)

    def _account(self, req: Request) -> None:
        self._count("completed")
        c = self.counters
        c.generated_tokens += len(req.output)
        c.steps += len(req.steps)
        c.accepted_draft_tokens += sum(s.accepted for s in req.steps)
        c.verified_draft_tokens += sum(self.gamma if s.verified is None else s.verified for s in req.steps)

    def _fail_all(self, message: str, kind: str) -> None:
        for req, sink in list(self._live.values()):
            self.gen.cancel(req)
            self._count("failed" if kind == "internal" else "cancelled")
            self._fail(sink, message, kind)
        self._live.clear()

    def _count(self, outcome: str) -> None:
        with self._cond:  # submit() and reject() count too, from Triton's threads
            self.counters.outcomes[outcome] += 1

    def _publish(self) -> None:
        occ = Occupancy(len(self.gen.active) + len(self.gen.prefilling), len(self.gen.waiting),
                        len(self.gen.free_slots))
        with self._cond:
            self._queued = occ.waiting
        self._occupancy = occ
        if self._on_change is not None:
            try:
                self._on_change(self.counters, occ)
            except Exception:
                self._log(f"muse_spark metrics update failed:\n{traceback.format_exc()}")


def _safe_end(sink: Sink, req: Request) -> None:
    """The final response of a request ended by the server (its tokens so far, its finish reason)."""
    try:
        sink.deliver(req, [])
    except Exception:
        pass  # the client is gone


def _safe_fail(sink: Sink, message: str, kind: str) -> None:
    try:
        sink.fail(message, kind)
    except Exception:
        pass  # the client is gone; nothing left to tell it
