"""The HTTP front (serving/front.py) against a real upstream: a small aiohttp server that stands
in for tritonserver's HTTP API (echo, binary infer, ready, an SSE stream, a request that hangs)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from muse_spark.serving.front import FrontError, HttpFront  # noqa: E402


def wait_for(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def lower(headers) -> dict:
    return {k.lower(): v for k, v in headers.items()}


class Upstream:
    """A stand-in for tritonserver's HTTP server, on its own event loop thread."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict, bytes]] = []  # method, path?query, headers, body
        self.disconnects: list[str] = []  # paths whose handler saw its client go away
        self.stream_done: float | None = None  # when the last stream sent its last event
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._stopped = False
        self._call(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self):
        self._release = asyncio.Event()

        @web.middleware
        async def record(request, handler):
            body = await request.read()
            self.requests.append((request.method, request.path_qs, lower(request.headers), body))
            return await handler(request)

        app = web.Application(middlewares=[record], client_max_size=64 << 20)
        async def metadata(request):
            return web.json_response({"name": "triton", "version": "2.51.0"})

        async def ok(request):
            return web.Response()

        app.router.add_get("/v2", metadata)
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/{m}/ready", "/v2/models/{m}/versions/{v}/ready"):
            app.router.add_get(path, ok)
        app.router.add_post("/v2/models/{m}/generate", self._generate)
        app.router.add_post("/v2/models/{m}/infer", self._infer)
        app.router.add_post("/v2/models/{m}/generate_stream", self._stream)
        app.router.add_get("/v2/models/{m}/config", self._partial)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.3)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _generate(self, request):
        body = await request.json()
        if body.get("hang"):
            try:
                await self._release.wait()
            except asyncio.CancelledError:
                self.disconnects.append(request.path)
                raise
        return web.json_response({"model": request.match_info["m"], "echo": body, "query": dict(request.query),
                                  "headers": lower(request.headers)}, status=body.get("status", 200))

    async def _infer(self, request):
        data = await request.read()
        return web.Response(body=data[::-1], content_type="application/octet-stream", headers={
            "Inference-Header-Content-Length": request.headers.get("Inference-Header-Content-Length", "-")})

    async def _stream(self, request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            for i in range(body["n"]):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await asyncio.sleep(body["delay"])
        except (asyncio.CancelledError, ConnectionError):
            self.disconnects.append(request.path)
            raise
        self.stream_done = time.monotonic()
        await resp.write_eof()
        return resp

    async def _partial(self, request):
        """10 of the 100 bytes it announces, then nothing until released."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 100
        await resp.prepare(request)
        await resp.write(b'{"name": "')
        await self._release.wait()
        await resp.write(b"m" * 88 + b'"}')
        return resp

    def paths(self):
        return [path for _, path, _, _ in self.requests]

    def release(self):
        self._loop.call_soon_threadsafe(self._release.set)

    def stop(self):
        if not self._stopped:
            self._stopped = True
            self._call(self._runner.cleanup())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


@pytest.fixture
def upstream():
    up = Upstream()
    yield up
    up.release()
    up.stop()


@pytest.fixture
def make_front(upstream):
    fronts = []

    def make(**kw):
        logs = []
        kw.setdefault("max_request_bytes", 1000)
        f = HttpFront(host="127.0.0.1", port=0, upstream=upstream.url, log=logs.append, **kw)
        f.start()
        f.logs = logs
        fronts.append(f)
        return f

    yield make
    upstream.release()
    for f in fronts:
        f.stop(timeout=1)


@pytest.fixture
def front(make_front):
    return make_front()


def call(front, method, path, body=None, headers=None, timeout=10):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def post_json(front, path, obj, **kw):
    status, headers, body = call(front, "POST", path, json.dumps(obj).encode(),
                                 {"Content-Type": "application/json"}, **kw)
    return status, json.loads(body)


def open_stream(front, n, delay):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    conn.request("POST", "/v2/models/m/generate_stream", json.dumps({"n": n, "delay": delay}).encode(),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def events(resp):
    """(arrival time, parsed data) for each SSE event, as it arrives."""
    buf = b""
    while chunk := resp.read1(65536):
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            yield time.monotonic(), json.loads(event[len(b"data: "):])
    assert buf == b"", buf


def raw_request(port, head: bytes, body_chunks=(), timeout=10) -> bytes:
    """Send a request by hand (small chunks, errors from a server that stops reading ignored)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head)
            for chunk in body_chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while data := s.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
        return answer


# ---- forwarding ----

def test_forwards_json_status_codes_headers_and_binary(front, upstream):
    status, data = post_json(front, "/v2/models/m/generate?x=1", {"text_input": "hi", "parameters": {"a": 2}})
    assert status == 200
    assert data["model"] == "m" and data["echo"] == {"text_input": "hi", "parameters": {"a": 2}}
    assert data["query"] == {"x": "1"}

    # End-to-end headers pass, hop-by-hop ones (and those Connection names) do not.
    status, _, body = call(front, "POST", "/v2/models/m/generate", b'{"status": 400}',
                           {"X-Request-Id": "abc", "Connection": "keep-alive, X-Hop", "X-Hop": "1",
                            "Keep-Alive": "timeout=5"})
    seen = json.loads(body)["headers"]
    assert status == 400 and json.loads(body)["echo"] == {"status": 400}
    assert seen["x-request-id"] == "abc"
    assert "x-hop" not in seen and "keep-alive" not in seen
    assert seen["host"] == f"127.0.0.1:{upstream.port}"
    # Nothing the client did not send (a gzip Accept-Encoding would change the body relayed).
    assert seen["accept-encoding"] == "identity" and "user-agent" not in seen and "content-type" not in seen

    blob = bytes(range(256)) * 3 + b"\x00\xff"  # binary tensor data
    status, headers, body = call(front, "POST", "/v2/models/m/infer", blob,
                                 {"Inference-Header-Content-Length": "17",
                                  "Content-Type": "application/octet-stream"})
    assert status == 200 and body == blob[::-1]
    assert headers["Inference-Header-Content-Length"] == "17"
    assert headers["Content-Type"] == "application/octet-stream"
    assert upstream.requests[-1][3] == blob

    status, _, body = call(front, "GET", "/v2")
    assert status == 200 and json.loads(body)["version"] == "2.51.0"
    assert call(front, "GET", "/v2/health/live")[0] == 200
    assert call(front, "GET", "/v2/models/m/versions/1/ready")[0] == 200
    assert call(front, "GET", "/v2/repository/index")[0] == 404  # the upstream's 404, relayed
    wait_for(lambda: front.inflight == 0, what="no request in flight")  # (its bookkeeping ends just after the response)


def test_sse_events_arrive_incrementally(front, upstream):
    t0 = time.monotonic()
    conn, resp = open_stream(front, n=5, delay=0.3)
    try:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        got = list(events(resp))
    finally:
        conn.close()
    assert [data for _, data in got] == [{"i": i} for i in range(5)]
    first_at = got[0][0]
    assert upstream.stream_done is not None and upstream.stream_done - t0 >= 1.2
    assert first_at - t0 < 1.0 and first_at < upstream.stream_done - 0.8  # not held back till the end
    assert all(b - a > 0.1 for (a, _), (b, _) in zip(got, got[1:]))


# ---- the size bound ----

def test_oversized_body_with_content_length_refused(front, upstream):
    body = json.dumps({"text_input": "x" * 1000}).encode()
    status, _, answer = call(front, "POST", "/v2/models/m/generate", body)
    assert status == 413 and len(body) == 1018
    assert json.loads(answer) == {"error": "request body of 1018 bytes exceeds the server's limit of 1000 bytes "
                             "(--max-request-bytes)"}
    assert upstream.requests == []
    assert len(front.logs) == 1 and "413" in front.logs[0] and "/v2/models/m/generate" in front.logs[0]

    exact = json.dumps({"text_input": "x" * 982}).encode()
    assert len(exact) == 1000
    status, _, body = call(front, "POST", "/v2/models/m/generate", exact)
    assert status == 200 and json.loads(body)["echo"]["text_input"] == "x" * 982


def test_oversized_chunked_body_refused(front, upstream):
    status, _, body = call(front, "POST", "/v2/models/m/generate", iter([b'{"text_input": "', b"y" * 600,
                                                                          b"y" * 600, b'"}']))
    assert status == 413
    assert "exceeds the server's limit of 1000 bytes (--max-request-bytes)" in json.loads(body)["error"]
    assert upstream.requests == []

    # A chunked body within the limit reaches the upstream in one piece.
    status, _, body = call(front, "POST", "/v2/models/m/generate", iter([b'{"text_input": ', b'"small"}']))
    assert status == 200 and json.loads(body)["echo"] == {"text_input": "small"}
    assert upstream.requests[-1][2]["content-length"] == str(len(b'{"text_input": "small"}'))


def test_4mib_body_by_raw_socket_refused_and_front_keeps_serving(make_front, upstream):
    front = make_front(max_request_bytes=1 << 20)
    size, piece = 4 << 20, b"z" * 8192
    path = "/v2/models/muse_spark/generate"

    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    answer = raw_request(front.port, head, (piece for _ in range(size // len(piece))))
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert f"request body of {size} bytes exceeds the server's limit of {1 << 20} bytes".encode() in answer

    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (size // len(piece)) + [b"0\r\n\r\n"]
    answer = raw_request(front.port, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]

    # Expect: 100-continue with a large Content-Length: refused before the body is sent.
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n"
            f"Expect: 100-continue\r\n\r\n").encode()
    answer = raw_request(front.port, head)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]

    # Expect: 100-continue within the limit: "100 Continue", then the forwarded answer.
    small = b'{"text_input": "ok"}'
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(small)}\r\nConnection: close\r\n"
            f"Expect: 100-continue\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(head)
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(small)
        answer = b""
        while data := s.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"echo": {"text_input": "ok"}' in answer

    assert upstream.paths() == [path]  # only the small one
    assert len(front.logs) == 3
    status, data = post_json(front, path, {"text_input": "still here"})
    assert status == 200 and data["echo"]["text_input"] == "still here"


# ---- readiness ----

def test_set_ready_false_refuses_ready_and_inference_until_true(front, upstream):
    reason = "the model process died; restarting"
    front.set_ready(False, reason=reason)
    assert not front.ready
    for path in ("/v2/health/ready", "/v2/models/m/ready", "/v2/models/m/versions/1/ready"):
        status, _, body = call(front, "GET", path)
        assert status == 503 and reason in json.loads(body)["error"], path
    for path in ("/v2/models/m/generate", "/v2/models/m/generate_stream", "/v2/models/m/infer",
                 "/v2/models/m/versions/1/infer"):
        status, data = post_json(front, path, {"text_input": "hi"})
        assert status == 503 and reason in data["error"], path
    assert call(front, "GET", "/v2/health/live")[0] == 200
    assert call(front, "GET", "/v2")[0] == 200  # metadata still forwarded
    assert upstream.paths() == ["/v2"]
    assert len(front.logs) == 4 and all(reason in line for line in front.logs)

    front.set_ready(True)
    assert call(front, "GET", "/v2/health/ready")[0] == 200
    assert call(front, "GET", "/v2/models/m/ready")[0] == 200
    status, data = post_json(front, "/v2/models/m/generate", {"text_input": "back"})
    assert status == 200 and data["echo"]["text_input"] == "back"


# ---- ending in-flight requests ----

def run_in_thread(fn, *args, **kw):
    result = {}

    def target():
        try:
            result["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e
        result["at"] = time.monotonic()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, result


def test_fail_inflight_ends_a_waiting_request_with_503(front, upstream):
    t, result = run_in_thread(post_json, front, "/v2/models/m/generate", {"hang": True}, timeout=60)
    wait_for(lambda: front.inflight == 1 and upstream.paths() == ["/v2/models/m/generate"], what="in flight")
    time.sleep(0.1)
    assert "value" not in result  # it really hangs
    t0 = time.monotonic()
    assert front.fail_inflight("the model process died") == 1
    t.join(30)
    assert not t.is_alive() and "error" not in result, result
    assert result["at"] - t0 < 2.0
    assert result["value"] == (503, {"error": "the model process died"})
    wait_for(lambda: upstream.disconnects == ["/v2/models/m/generate"], what="the upstream request to close")
    wait_for(lambda: front.inflight == 0, what="no request in flight")
    assert front.fail_inflight("nothing left") == 0


def test_fail_inflight_ends_a_stream_with_an_error_event(front, upstream):
    conn, resp = open_stream(front, n=200, delay=0.05)
    try:
        got = events(resp)
        _, first = next(got)
        assert first == {"i": 0}
        t0 = time.monotonic()
        assert front.fail_inflight("the model process died") == 1
        rest = list(got)  # ends: the front closes the stream
    finally:
        conn.close()
    assert time.monotonic() - t0 < 2.0
    assert rest and rest[-1][1] == {"error": "the model process died"}
    assert all("i" in data for _, data in rest[:-1]) and len(rest) < 100
    wait_for(lambda: upstream.disconnects == ["/v2/models/m/generate_stream"], what="the upstream stream to close")
    wait_for(lambda: front.inflight == 0, what="no request in flight")


def test_fail_inflight_cuts_a_plain_body_short(front, upstream):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        conn.request("GET", "/v2/models/m/config")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["Content-Length"] == "100"
        assert resp.read1(100) == b'{"name": "'
        assert front.inflight == 1
        assert front.fail_inflight("the model process died") == 1
        with pytest.raises(http.client.IncompleteRead) as e:
            resp.read()  # the connection ends: the body does not pass for complete
        assert e.value.partial == b""
    finally:
        conn.close()
    wait_for(lambda: front.inflight == 0, what="no request in flight")


# ---- clients and upstreams that go away ----

def test_client_disconnect_reaches_the_upstream(front, upstream, caplog):
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    body = json.dumps({"n": 200, "delay": 0.05}).encode()
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"POST /v2/models/m/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
              % (len(body), body))
    seen = b""
    while b"data: " not in seen:
        seen += s.recv(4096)
    s.close()
    wait_for(lambda: upstream.disconnects == ["/v2/models/m/generate_stream"], what="the stream's disconnect")

    # Also while the front still waits for the upstream's response headers.
    body = json.dumps({"hang": True}).encode()
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
              % (len(body), body))
    wait_for(lambda: len(upstream.requests) == 2 and front.inflight == 1, what="the request in flight")
    s.close()
    wait_for(lambda: upstream.disconnects[1:] == ["/v2/models/m/generate"], what="the request's disconnect")
    wait_for(lambda: front.inflight == 0, what="no request in flight")
    assert front.logs == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def break_off_two_requests(front, upstream, then=lambda: None):
    """A request waiting for its response and a stream relaying events when the upstream goes away (its
    connections close mid-request), ``then()`` after it → (the waiting request's thread, its result, the stream's
    events after the first)."""
    t, result = run_in_thread(post_json, front, "/v2/models/m/generate", {"hang": True}, timeout=60)
    conn, resp = open_stream(front, n=200, delay=0.05)
    try:
        got = events(resp)
        assert next(got)[1] == {"i": 0}
        wait_for(lambda: front.inflight == 2, what="two requests in flight")
        upstream.stop()
        then()
        rest = list(got)
    finally:
        conn.close()
    return t, result, rest


def test_upstream_gone_gives_json_errors(front, upstream):
    t, result, rest = break_off_two_requests(front, upstream)  # tritonserver gone
    assert "broke off" in rest[-1][1]["error"]
    t.join(30)
    assert not t.is_alive() and "error" not in result, result
    status, data = result["value"]
    assert status == 502 and "the model server broke off the request" in data["error"]

    status, data = post_json(front, "/v2/models/m/generate", {"text_input": "hi"})
    assert status == 503 and "not reachable" in data["error"]
    status, _, body = call(front, "GET", "/v2/health/ready")
    assert status == 503 and "not reachable" in json.loads(body)["error"]
    wait_for(lambda: front.inflight == 0, what="no request in flight")


def test_a_request_broken_off_as_the_model_process_dies_gets_the_launchers_reason(front, upstream):
    """The upstream breaks the stream off when the model process dies, a poll before the launcher sees the death
    and calls ``fail_inflight``: the client gets that reason (a final error event, a 503), not the bare break."""
    def launcher_sees_it():
        time.sleep(0.3)  # (the launcher's poll)
        assert front.fail_inflight("the model process (pid 7) died while serving this request; retry it") == 2

    t, result, rest = break_off_two_requests(front, upstream, launcher_sees_it)
    assert rest[-1][1] == {"error": "the model process (pid 7) died while serving this request; retry it"}
    t.join(30)
    assert result["value"] == (503, {"error": "the model process (pid 7) died while serving this request; retry it"})
    wait_for(lambda: front.inflight == 0, what="no request in flight")
    assert not any("broke off" in line for line in front.logs), front.logs


# ---- starting and stopping ----

def test_occupied_port_raises_at_start(upstream):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        threads = threading.active_count()
        f = HttpFront(host="127.0.0.1", port=port, upstream=upstream.url, log=lambda m: None)
        with pytest.raises(FrontError, match=f"127.0.0.1:{port}"):
            f.start()
        assert isinstance(FrontError("x"), RuntimeError)
        assert threading.active_count() == threads  # its loop thread is gone
        f.stop()  # a no-op


def test_stop_fails_what_is_still_in_flight(make_front, upstream):
    front = make_front()
    port = front.port
    t, result = run_in_thread(post_json, front, "/v2/models/m/generate", {"hang": True}, timeout=60)
    wait_for(lambda: front.inflight == 1, what="in flight")
    t0 = time.monotonic()
    front.stop(timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    t.join(30)
    assert not t.is_alive() and "error" not in result, result
    assert result["value"] == (503, {"error": "the server is shutting down"})
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
