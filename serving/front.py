"""A small HTTP front that stands between clients and ``tritonserver``'s HTTP server.

Why it exists:

* **Large bodies crash tritonserver.** Its HTTP server (2.51, the one the
  ``nvidia-pytriton`` wheel ships) dies with a segfault when a client sends a
  large body (a few MiB to ``/v2/models/<m>/generate`` is enough), taking every
  other request down with it, and it has no option to bound the request size.
  The front reads each body itself, refuses one larger than
  ``max_request_bytes`` with HTTP 413 (before reading it when Content-Length
  says so, as soon as the limit is passed for a chunked body), and sends the
  upstream only bodies it has read completely, in one piece.
* **The model process can die behind a live tritonserver.** Clients waiting
  for a response (or in the middle of a ``generate_stream`` event stream) would
  hang. The launcher calls :meth:`HttpFront.set_ready` (``False``: ready
  endpoints and new inference requests answer 503 with the reason) and
  :meth:`HttpFront.fail_inflight` (every forwarded request ends now: 503 with
  a JSON error if no response has started, a final ``data: {"error": ...}``
  event for an event stream already relaying).

Two hooks let the launcher add what tritonserver's HTTP cannot do itself:
``check_body(path, body)`` may refuse an inference request's body with 400
before it is forwarded (tritonserver casts JSON integers to the input's type
without a range check); and an inference error whose message starts with
``unavailable:`` (a full queue: this python backend answers every model error
with 400) is relayed as 503 with ``Retry-After``.

Everything else is a plain reverse proxy: any method and path, headers passed
through except hop-by-hop ones, status and body relayed as they come (chunk by
chunk, so Server-Sent Events are not buffered). A client that goes away closes
its upstream request, so Triton sees the cancellation. If the upstream cannot be
reached or breaks off, the client gets a 503/502 JSON error (or a final error
event), never a hang; an inference request broken off as the model process dies gets
the launcher's reason (``BROKEN_OFF_WAIT_S``).

The front runs its own asyncio loop in a background thread, so the synchronous
launcher drives it with :meth:`start` (binds the public port at once, before
tritonserver starts, so an occupied port is reported immediately), ``set_ready``,
``fail_inflight`` and :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web
from yarl import URL

# RFC 9110 §7.6.1 hop-by-hop headers, plus what the front itself recomputes.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length", "expect"}
_READY_PATH = re.compile(r"^/v2/health/ready$|^/v2/models/[^/]+(/versions/[^/]+)?/ready$")
_INFER_PATH = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)$")
# An inference request the upstream broke off waits this long for the launcher's word on why
# (``fail_inflight``: the model process died), which it then gives the client instead of the bare break:
# the stream breaks as the process dies, the launcher sees the death on its next poll.
BROKEN_OFF_WAIT_S = 2.0


class FrontError(RuntimeError):
    """The front cannot run (e.g. its port is taken); the message says where and why."""


class _ClientGone(Exception):
    """The client's connection broke while the front was reading from or writing to it."""


@dataclass(eq=False)
class _Exchange:
    """One request being forwarded: its handler task and how far its response got."""
    task: asyncio.Task
    failure: str | None = None  # set by fail_inflight before it cancels the task
    sse: bool = False
    tail: bytes = b"\n\n"  # the last bytes relayed (where an event ends)


def _error(status: int, message: str, *, close: bool = False) -> web.Response:
    resp = web.json_response({"error": message}, status=status)
    if close:
        resp.force_close()
    return resp


def _says_unavailable(body: bytes) -> bool:
    """Whether a model's error body says ``unavailable: …`` (a full queue: retry later)."""
    try:
        message = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(message, str) and message.startswith("unavailable:")


def _forwarded(headers, drop) -> list[tuple[str, str]]:
    named = {h.strip().lower() for v in headers.getall("Connection", []) for h in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in drop and k.lower() not in named]


class HttpFront:
    """Reverse proxy on ``host:port`` to ``upstream`` (``http://127.0.0.1:PORT``), see the module doc."""

    def __init__(self, *, host: str, port: int, upstream: str, max_request_bytes: int = 1 << 20,
                 check_body: Callable[[str, bytes], str | None] | None = None,
                 log: Callable[[str], None] = print):
        if max_request_bytes < 0:
            raise ValueError(f"max_request_bytes must be >= 0, not {max_request_bytes}")
        self.host, self.requested_port = host, port
        self.upstream = upstream.rstrip("/")
        self.max_request_bytes = max_request_bytes
        self._check_body = check_body
        self._log = log
        self._ready, self._reason = True, ""
        self._stopping = False
        self._inflight: set[_Exchange] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port: int | None = None  # the bound port once started (useful with port=0)

    # ---- the launcher's side (any thread) ----

    @property
    def inflight(self) -> int:
        """How many requests are being forwarded now (waiting for or relaying a response)."""
        return len(self._inflight)

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool, reason: str = "") -> None:
        """``False``: ready endpoints and new inference requests answer 503 naming ``reason``.

        Live answers 200 meanwhile (from the front: tritonserver may be restarting)."""
        self._reason = reason or "the model is not ready"
        self._ready = bool(ready)

    def start(self, timeout: float = 30.0) -> None:
        """Bind ``host:port`` and serve in a background thread; :class:`FrontError` if it cannot."""
        if self._thread is not None:
            raise FrontError("the HTTP front is already started")
        self._stopping = False
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="http-front", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        self._loop, self._thread = loop, thread

    def stop(self, timeout: float = 10.0) -> None:
        """Stop listening, let in-flight requests finish for up to ``timeout`` s, fail the rest."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(timeout), loop).result(timeout + 10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    def fail_inflight(self, message: str) -> int:
        """End every forwarded request now with ``message`` (503, or a final SSE error event).

        Returns how many requests it ended."""
        if self._loop is None:
            return 0
        return asyncio.run_coroutine_threadsafe(self._fail_all(message), self._loop).result(10)

    # ---- the loop's side ----

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),  # one connection per request
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),  # streams may be long
            auto_decompress=False,  # bodies are relayed byte for byte, Content-Encoding included
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle, expect_handler=self._expect)
        # handler_cancellation: a client that disconnects cancels its handler, which closes
        # the upstream request (a non-streamed request would otherwise wait for its response).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.requested_port)
        try:
            await self._site.start()
        except OSError as e:
            await self._runner.cleanup()
            await self._session.close()
            raise FrontError(f"cannot listen on {self.host}:{self.requested_port}: {e.strerror or e}"
                             " (is another server using this port?)") from e
        self.port = self._runner.addresses[0][1]

    async def _stop(self, timeout: float) -> None:
        self._stopping = True
        await self._site.stop()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self._fail_all("the server is shutting down")
        await self._runner.cleanup()
        await self._session.close()

    async def _fail_all(self, message: str) -> int:
        pending = [ex for ex in self._inflight if ex.failure is None]
        for ex in pending:
            ex.failure = message
            ex.task.cancel()
        if pending:
            self._log(f"http front: ended {len(pending)} in-flight request(s): {message}")
        return len(pending)

    def _refusal(self, request: web.BaseRequest) -> web.Response | None:
        """The answer to a request that must not reach the upstream, judged from its headers."""
        path = request.path
        if not self._ready or self._stopping:
            reason = "the server is shutting down" if self._stopping else self._reason
            if path == "/v2/health/live":  # the server lives on while the model restarts
                return web.Response(status=200)
            if _READY_PATH.match(path):
                return _error(503, reason)
            if _INFER_PATH.match(path):
                return self._refuse(request, 503, f"the server is not ready for inference: {reason}")
        size = request.content_length
        if size is not None and size > self.max_request_bytes:
            return self._refuse(request, 413, self._too_large(size))
        return None

    def _refuse(self, request: web.BaseRequest, status: int, message: str) -> web.Response:
        self._log(f"http front: refused {request.method} {request.path}: {status} {message}")
        return _error(status, message, close=status == 413)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (f"request body of {'more than ' if at_least else ''}{size} bytes exceeds the server's "
                f"limit of {self.max_request_bytes} bytes (--max-request-bytes)")

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        # Judge Expect: 100-continue before the client sends its body.
        refusal = self._refusal(request)
        if refusal is not None:
            # The client holds its body back: answer now and close (RFC 9110 §10.1.1), rather
            # than wait for a body that may never come.
            await refusal.prepare(request)
            await refusal.write_eof()
            request.transport.close()
            return refusal
        if request.version != aiohttp.HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _error(417, f"unknown expectation: {request.headers['Expect']}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
        return None

    async def _read_body(self, request: web.BaseRequest) -> bytes | None:
        """The whole body, or None once it exceeds the limit."""
        body = bytearray()
        try:
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > self.max_request_bytes:
                    return None
        except ConnectionError:
            raise _ClientGone from None
        return bytes(body)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            refusal = self._refusal(request)
            if refusal is not None:
                return refusal
            body = await self._read_body(request)
            if body is None:
                return self._refuse(request, 413, self._too_large(self.max_request_bytes, at_least=True))
            if self._check_body is not None and _INFER_PATH.match(request.path):
                problem = self._check_body(request.path, body)
                if problem is not None:
                    return self._refuse(request, 400, problem)
            ex = _Exchange(asyncio.current_task())
            self._inflight.add(ex)
            try:
                return await self._forward(request, body, ex)
            finally:
                self._inflight.discard(ex)
        except _ClientGone:
            return web.Response(status=499)  # nobody reads it; aiohttp drops the connection
        except Exception as e:  # a bug; say so in one line and keep serving
            self._log(f"http front: {request.method} {request.path} failed: {type(e).__name__}: {e}")
            return _error(500, f"the HTTP front failed: {type(e).__name__}: {e}")

    async def _forward(self, request: web.Request, body: bytes, ex: _Exchange) -> web.StreamResponse:
        resp: web.StreamResponse | None = None
        try:
            async with self._session.request(
                    request.method, URL(self.upstream + request.raw_path, encoded=True), data=body or None,
                    headers=_forwarded(request.headers, _NOT_FORWARDED), allow_redirects=False) as up:
                error = await up.read() if up.status == 400 and _INFER_PATH.match(request.path) else None
                if error is not None and _says_unavailable(error):
                    return web.Response(body=error, status=503, content_type="application/json",
                                        headers={"Retry-After": "1"})
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in _forwarded(up.headers, _HOP_BY_HOP):
                    resp.headers.add(k, v)
                ex.sse = up.content_type == "text/event-stream"
                await self._write(request, resp)
                if error is not None:  # (already read)
                    await self._write(request, resp, error)
                async for chunk in up.content.iter_any():  # as it arrives: events are not held back
                    await self._write(request, resp, chunk)
                    ex.tail = (ex.tail + chunk)[-2:]
                await self._write(request, resp, eof=True)
                return resp
        except asyncio.CancelledError:
            if ex.failure is None:  # the client went away (or the server stops): let it cancel
                raise
            asyncio.current_task().uncancel()
            return await self._end(request, resp, ex, 503, ex.failure)
        except aiohttp.ClientConnectorError as e:
            message = f"the model server is not reachable ({e})"
            if _INFER_PATH.match(request.path):  # (health checks while tritonserver starts are expected)
                self._log(f"http front: {request.method} {request.path}: {message}")
            return await self._end(request, resp, ex, 503, message)
        except (aiohttp.ClientError, OSError) as e:
            message = f"the model server broke off the request ({type(e).__name__}: {e})"
            if _INFER_PATH.match(request.path) and await self._reason_given(ex) is not None:
                return await self._end(request, resp, ex, 503, ex.failure)
            self._log(f"http front: {request.method} {request.path}: {message}")
            return await self._end(request, resp, ex, 502, message)

    @staticmethod
    async def _reason_given(ex: _Exchange) -> str | None:
        """The reason ``fail_inflight`` gives ``ex`` within ``BROKEN_OFF_WAIT_S``, else None."""
        try:  # (fail_inflight sets the reason, then cancels the exchange's task: the sleep ends with it)
            await asyncio.sleep(BROKEN_OFF_WAIT_S)
        except asyncio.CancelledError:
            if ex.failure is None:
                raise
            asyncio.current_task().uncancel()
        return ex.failure

    @staticmethod
    async def _write(request, resp, data: bytes = b"", eof: bool = False) -> None:
        try:
            if not resp.prepared:
                await resp.prepare(request)
            if data:
                await resp.write(data)
            if eof:
                await resp.write_eof()
        except ConnectionError:  # includes aiohttp's ClientConnectionResetError
            raise _ClientGone from None

    async def _end(self, request, resp, ex: _Exchange, status: int, message: str) -> web.StreamResponse:
        """Finish a failed exchange: an error response, a final error event, or a cut connection."""
        if resp is None or not resp.prepared:
            return _error(status, message)
        if ex.sse:
            event = b"" if ex.tail.endswith(b"\n\n") else b"\n\n"  # end a partly relayed event
            event += b"data: " + json.dumps({"error": message}).encode() + b"\n\n"
            try:
                await self._write(request, resp, event, eof=True)
            except _ClientGone:
                pass
            return resp
        # A body cut short must not look complete (a final empty chunk would say it is).
        resp.force_close()
        if request.transport is not None:
            request.transport.close()
        return resp
