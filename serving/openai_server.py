"""``muse-spark serve-openai --engine DIR``: an OpenAI-compatible HTTP server over one engine.

    muse-spark serve-openai --engine engines/tiny --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

Routes: ``GET /v1/models`` (the one model, named ``--served-model-name``, by
default the engine directory's name), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health`` (200 while the engine is loaded
and the scheduler thread runs, else 503) and ``GET /metrics`` (Prometheus text).

Requests of all clients go to one scheduler thread — the Triton model's
(``scheduler.py``): it drives the ``Generator``, new requests join between
speculative steps and a finished one frees its slot at once (in-flight
batching). Each request's sink (``_Sink``, called on the scheduler thread)
detokenizes its new tokens, applies its stop strings — at the first one the
request is ended on the spot (``Generator.cancel(req, "stop")``), so its slot
goes to the next request in the same step — and hands the text to the request's
handler on the event loop. A client that goes away (mid-stream, or while a
non-streamed request waits) marks its sink cancelled; the scheduler then
cancels the request and frees its slot.

What a request may ask, and how a bad one is answered, is in
``openai_protocol.py``. Errors come in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``): 400 for an invalid or
unsupported request, 404 for an unknown model or path, 413 for a body over
``--max-request-bytes``, 503 (with ``Retry-After``) when the queue is full or
the server is draining, 500 when the engine fails. A request is checked
completely before it is submitted, so a streamed response starts only for a
request that is running: an error after that (the engine failing) is a final
``data: {"error": …}`` event before ``data: [DONE]``.

Shutdown (SIGINT/SIGTERM): the server stops listening, new requests get 503,
running ones may go on for ``--exit-timeout`` seconds, then end with the text
they have and finish reason ``shutdown`` (``Scheduler.drain``).

This module imports no torch, FastAPI or uvicorn until a command runs
(``muse-spark --help`` stays instant; FastAPI and uvicorn are the ``openai``
extra).
"""

# (No `from __future__ import annotations`: FastAPI reads the routes' annotations, e.g. `Request`, as
# objects, and they are imported inside create_app.)
import argparse
import asyncio
import contextlib
import datetime
import json
import signal
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from muse_spark.serving.server import ServingError, _port, _positive, _seconds
from muse_spark.serving.supervisor import port_in_use

OPENAI_EXTRA_HINT = "install the openai extra: pip install 'muse-spark[openai]' (fastapi, uvicorn, jinja2)"
POLL_DISCONNECT_SECONDS = 0.25  # how often a handler waiting for a non-streamed answer checks its client


def _log(msg: str) -> None:
    print(f"muse-spark serve-openai: {msg}", file=sys.stderr, flush=True)


# ---- the service: one engine, one scheduler thread ------------------------------------------
class _Stats:
    """What the scheduler's ``Counters`` do not keep, from the requests that complete (finish reason
    ``stop`` or ``length``, the ones the scheduler counts as completed): prompt tokens and, per draft
    position k (1 … γ), the steps whose k-th draft was accepted."""

    def __init__(self, gamma: int):
        self.prompt_tokens = 0
        self.accepted_by_position = [0] * gamma
        self._lock = threading.Lock()

    def add(self, req) -> None:
        with self._lock:
            self.prompt_tokens += len(req.prompt)
            for step in req.steps:
                for k in range(min(step.accepted, len(self.accepted_by_position))):
                    self.accepted_by_position[k] += 1

    def snapshot(self) -> tuple[int, list[int]]:
        with self._lock:
            return self.prompt_tokens, list(self.accepted_by_position)


class OpenAIService:
    """The engine, its tokenizer and chat template, and the scheduler thread the routes submit to."""

    def __init__(self, engine_dir: str | Path, *, served_model_name: str | None = None, device: str | None = None,
                 max_queue: int = 256, log=_log):
        # (torch and the runtime load here, when a server is made, not when the CLI parses its arguments)
        from muse_spark.engine_format import read_manifest
        from muse_spark.runtime import load_engine, load_tokenizer
        from muse_spark.serving.openai_protocol import ServedModel
        from muse_spark.serving.scheduler import Scheduler

        engine_dir = Path(engine_dir)
        self.engine = load_engine(engine_dir, device=device)
        manifest = read_manifest(engine_dir)
        self.created = _epoch(manifest.get("created"))
        tokenizer = load_tokenizer(self.engine.tokenizer_path)
        template = chat_template(engine_dir, manifest)
        self.scheduler = Scheduler(self.engine, max_queue=max_queue, log=log)
        name = served_model_name or engine_dir.resolve().name
        self.served = ServedModel(name, self.scheduler.gen, tokenizer, template, self.engine.max_seq,
                                  self.engine.gamma)
        self.stats = _Stats(self.engine.gamma)
        self.draining = False
        self._started = False

    def start(self) -> None:
        self.scheduler.start()
        self._started = True

    def drain(self, grace: float) -> None:
        self.draining = True
        self.scheduler.drain(grace)

    def stop(self) -> None:
        self.draining = True
        self.scheduler.stop()

    def problem(self) -> str | None:
        """Why the service cannot take requests now, or None."""
        if self.draining:
            return "the server is shutting down"
        thread = getattr(self.scheduler, "_thread", None)  # (the Scheduler keeps no public liveness flag)
        if not self._started or thread is None or not thread.is_alive():
            return "the scheduler thread is not running (see the server log)"
        return None


def chat_template(engine_dir: Path, manifest: dict):
    """The engine's chat template (``ChatTemplate``), or None where it has none.

    The manifest names the engine's ``tokenizer_config.json`` (``"tokenizer_config"``); like the
    tokenizer it must be one of the hashed files, which loading the engine verified."""
    from jinja2 import TemplateSyntaxError

    from muse_spark.engine_format import EngineError
    from muse_spark.serving.openai_protocol import ChatTemplate

    name = manifest.get("tokenizer_config")
    if name is None:
        return None
    if not isinstance(name, str) or name not in manifest["files"]:
        raise EngineError(f"{engine_dir}: tokenizer_config {name!r} is not among the manifest's hashed files; "
                          f"refusing an unverified tokenizer config")
    path = engine_dir / name
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{path}: not a readable tokenizer_config.json ({e})") from None
    if not isinstance(config, dict):
        raise EngineError(f"{path}: a tokenizer_config.json must hold a JSON object")
    try:
        return ChatTemplate.from_config(config)
    except TemplateSyntaxError as e:
        raise EngineError(f"{path}: its chat_template does not compile: {e} (line {e.lineno})") from None


def _epoch(iso) -> int:
    try:
        return int(datetime.datetime.fromisoformat(iso).timestamp())
    except (TypeError, ValueError):
        return int(time.time())


# ---- one request: the scheduler's sink and the handler's events -----------------------------
@dataclass(frozen=True)
class _Text:
    """New text of a request (``finished``: the last, with its finish reason and token counts)."""
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class _Failure:
    message: str
    kind: str  # 'invalid' | 'unavailable' | 'cancelled' | 'internal' (the scheduler's kinds)

    def error(self):
        from muse_spark.serving.openai_protocol import ApiError

        if self.kind == "invalid":
            return ApiError(400, self.message)
        if self.kind == "unavailable":
            return ApiError(503, self.message, code="unavailable", headers={"Retry-After": "1"})
        if self.kind == "cancelled":
            return ApiError(503, self.message, code="cancelled")
        return ApiError(500, self.message, code="internal_error")


class _Disconnected(Exception):
    pass


class _Sink:
    """The scheduler's sink of one request (``scheduler.Sink``); its events go to the handler's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, service: OpenAIService, text, stream: bool):
        self.loop, self.service, self.text, self.stream = loop, service, text, stream
        self.events: deque = deque()
        self.ready = asyncio.Event()
        self.gone = False  # the client went away: the scheduler cancels the request
        self.done = False  # the handler has the request's last event

    # -- the scheduler thread's side --
    def deliver(self, req, new_tokens: list[int]) -> None:
        text = self.text
        if self.stream or text.stop or req.finished:
            text.feed(req.output, final=req.finished)
            if text.stopped and not req.finished:
                # A stop string: end the request now (the scheduler sees it finished and frees its slot).
                self.service.scheduler.gen.cancel(req, "stop")
        if not req.finished and not self.stream:
            return  # a non-streamed request gets one answer
        if req.finished and req.finish_reason in ("stop", "length"):
            self.service.stats.add(req)
        event = _Text(text.take(final=req.finished), req.finished, req.finish_reason if req.finished else None,
                      len(req.prompt), text.tokens if text.stopped else len(req.output))
        self.loop.call_soon_threadsafe(self._push, event)  # (raises once the loop is gone: the client is)

    def fail(self, message: str, kind: str) -> None:
        self.loop.call_soon_threadsafe(self._push, _Failure(message, kind))

    def cancelled(self) -> bool:
        return self.gone

    # -- the event loop's side --
    def _push(self, event) -> None:
        self.events.append(event)
        self.ready.set()

    async def next(self, request=None):
        """The next event; with ``request``, polls whether its client went away (``_Disconnected``)."""
        while not self.events:
            self.ready.clear()
            if request is None:
                await self.ready.wait()
                continue
            try:
                await asyncio.wait_for(self.ready.wait(), POLL_DISCONNECT_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    raise _Disconnected from None
        return self.events.popleft()


class _Shape:
    """The JSON of one request's answer: a completion or a chat completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(ev: _Text) -> dict:
        return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens}

    def response(self, ev: _Text) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": ev.text}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(ev)}
        choice = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": ev.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(ev)}

    def chunk(self, text: str, finish_reason: str | None, *, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, ev: _Text) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(ev)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(sink: _Sink, shape: _Shape, first):
    """The event stream of a running request (its first event already came); ``sink.done`` once its
    last event is out."""
    ev = first
    if shape.chat:
        yield _sse(shape.chunk("", None, role=True))
    while True:
        if isinstance(ev, _Failure):
            yield _sse(ev.error().body())
            break
        if ev.text or ev.finished:
            yield _sse(shape.chunk(ev.text, ev.finish_reason))
        if ev.finished:
            if shape.include_usage:
                yield _sse(shape.usage_chunk(ev))
            break
        ev = await sink.next()
    sink.done = True
    yield "data: [DONE]\n\n"


# ---- the app ------------------------------------------------------------------------------------
def create_app(service: OpenAIService, *, max_request_bytes: int = 1 << 20):
    """The FastAPI app over ``service`` (started by the caller: ``service.start()``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from muse_spark.serving.openai_protocol import ApiError, TextStream, parse_chat, parse_completion

    app = FastAPI(title="muse-spark", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    class EventStream(StreamingResponse):
        """An event stream whose request is cancelled when the response ends before its last event
        (the client went away: mid-stream, or before the stream began)."""

        def __init__(self, sink: _Sink, shape: _Shape, first):
            super().__init__(_events(sink, shape, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.sink = sink

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                if not self.sink.done:
                    self.sink.gone = True

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        err = ApiError(e.status_code, message.get(e.status_code, str(e.detail)))
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        _log(f"{request.method} {request.url.path} failed: {type(e).__name__}: {e}")
        err = ApiError(500, f"the server failed: {type(e).__name__}: {e}", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        problem = service.problem()
        if problem is not None:
            return JSONResponse(ApiError(503, problem).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(service), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": service.served.name, "object": "model", "created": service.created, "owned_by": "muse-spark",
                "max_model_len": service.served.max_seq}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != service.served.name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {service.served.name!r}",
                           param="model", code="model_not_found")
        return model_card()

    async def serve(request: Request, chat: bool):
        problem = service.problem()
        if problem is not None:
            raise ApiError(503, problem, code="unavailable", headers={"Retry-After": "1"})
        try:
            body = await _read_body(request, max_request_bytes)
            # (tokenizing and rendering off the event loop: a long prompt must not stall the other streams)
            parsed = await asyncio.to_thread(parse_chat if chat else parse_completion, body, service.served)
        except ApiError as e:
            service.scheduler.reject(_Answered(), e.message)  # (counted with the scheduler's rejections)
            raise
        shape = _Shape(chat, service.served.name, parsed.include_usage)
        sink = _Sink(asyncio.get_running_loop(), service, TextStream(service.served.tokenizer, parsed.stop),
                     parsed.stream)
        service.scheduler.submit(parsed.prompt, parsed.params, sink)
        streaming = False
        try:
            first = await sink.next(request)
            if isinstance(first, _Failure):
                raise first.error()
            if not parsed.stream:
                return JSONResponse(shape.response(first))
            streaming = True
            return EventStream(sink, shape, first)
        except _Disconnected:
            return Response(status_code=499)  # (nobody reads it)
        finally:
            if not streaming:
                sink.gone = True  # (a no-op for a finished request; cancels one whose client went away)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


class _Answered:
    """The sink of a request answered before it reached the scheduler (``Scheduler.reject`` counts it)."""

    def deliver(self, req, new_tokens) -> None:
        pass

    def fail(self, message: str, kind: str) -> None:
        pass

    def cancelled(self) -> bool:
        return True


async def _read_body(request, limit: int) -> bytes:
    """The whole body; 413 once it is over ``limit`` bytes (before reading it, when Content-Length says so)."""
    from muse_spark.serving.openai_protocol import ApiError

    def too_large(size: str) -> ApiError:
        return ApiError(413, f"request body of {size} bytes exceeds the server's limit of {limit} bytes "
                             f"(--max-request-bytes)", code="request_too_large", headers={"Connection": "close"})

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(f"more than {limit}")
    return bytes(body)


# ---- metrics ------------------------------------------------------------------------------------
def metrics_text(service: OpenAIService) -> str:
    """The Prometheus text exposition of the scheduler's counters, the requests' statistics and the slots."""
    c, occ = service.scheduler.counters, service.scheduler.occupancy
    prompt_tokens, by_position = service.stats.snapshot()
    model = 'model="' + service.served.name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{model}{labels}}} {value}")

    family("muse_spark_requests_total", "counter", "Requests by outcome: completed, rejected, cancelled, failed",
           [(f',outcome="{o}"', n) for o, n in sorted(c.outcomes.items())])
    family("muse_spark_prompt_tokens_total", "counter", "Prompt tokens of completed requests", [("", prompt_tokens)])
    family("muse_spark_generated_tokens_total", "counter", "Tokens generated by completed requests",
           [("", c.generated_tokens)])
    family("muse_spark_steps_total", "counter", "Speculative steps of completed requests (per request, summed)",
           [("", c.steps)])
    family("muse_spark_accepted_draft_tokens_total", "counter",
           "Draft tokens accepted (accepted / steps = mean accepted length - 1)", [("", c.accepted_draft_tokens)])
    family("muse_spark_accepted_draft_tokens_by_position_total", "counter",
           "Steps whose draft at this position (1 = the first) was accepted; / steps = acceptance rate per position",
           [(f',position="{k + 1}"', n) for k, n in enumerate(by_position)])
    family("muse_spark_active_requests", "gauge", "Requests holding a slot", [("", occ.active)])
    family("muse_spark_waiting_requests", "gauge", "Requests waiting for a slot", [("", occ.waiting)])
    family("muse_spark_free_slots", "gauge", "Free request slots", [("", occ.free_slots)])
    family("muse_spark_draft_length", "gauge", "Draft tokens per speculative step (gamma)",
           [("", service.served.gamma)])
    return "\n".join(lines) + "\n"


# ---- running it ---------------------------------------------------------------------------------
def serve_openai(engine_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, device: str | None = None, max_request_bytes: int = 1 << 20,
                 max_queue: int = 256, exit_timeout: float = 10.0, log_level: str = "info") -> int:
    """Load the engine, then serve on ``host:port`` until SIGINT/SIGTERM (which drains: see the module doc)."""
    try:
        import uvicorn
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError as e:
        raise ServingError(f"{e.name} is not installed; {OPENAI_EXTRA_HINT}") from None
    if port_in_use(host, port):
        raise ServingError(f"the port {host}:{port} is in use; choose another with --port")
    service = OpenAIService(engine_dir, served_model_name=served_model_name, device=device, max_queue=max_queue)
    app = create_app(service, max_request_bytes=max_request_bytes)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Our handlers, not uvicorn's: uvicorn raises the signal again once it has shut down, which
            # kills the process before the scheduler is stopped; here the run returns, and exits 0.
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                _log(f"draining: running requests may go on for {exit_timeout:g} s")
                service.drain(exit_timeout)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=int(exit_timeout) + 5)
    e = service.engine
    _log(f"serving {service.served.name!r} from {engine_dir} on http://{host}:{port}/v1 (γ={e.gamma}, "
         f"max_batch={e.max_batch}, max_seq={e.max_seq}, device={e.device}, chat template: "
         f"{'yes' if service.served.chat_template else 'no'})")
    service.start()
    try:
        Server(config).run()
    finally:
        service.stop()
    return 0


def add_serve_openai_command(sub) -> None:
    s = sub.add_parser("serve-openai", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                            "/v1/chat/completions) over an engine directory")
    s.add_argument("--engine", required=True, help="engine directory (from `muse-spark build`)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the engine directory's name)")
    s.add_argument("--device", default=None, help="run the engine here (cpu, cuda, cuda:1; default: the engine's)")
    s.add_argument("--max-request-bytes", type=_positive, default=1 << 20,
                   help="largest HTTP request body accepted (default 1 MiB); larger ones get HTTP 413")
    s.add_argument("--max-queue", type=_positive, default=256,
                   help="requests that may wait for a slot; more get HTTP 503 (default 256)")
    s.add_argument("--exit-timeout", type=_seconds, default=10.0,
                   help="on SIGINT/SIGTERM, seconds running requests may go on before they end with finish "
                        "reason 'shutdown' (default 10)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=cmd_serve_openai)


def cmd_serve_openai(a: argparse.Namespace) -> int:
    try:
        return serve_openai(a.engine, host=a.host, port=a.port, served_model_name=a.served_model_name,
                            device=a.device, max_request_bytes=a.max_request_bytes, max_queue=a.max_queue,
                            exit_timeout=a.exit_timeout, log_level=a.log_level)
    except ServingError as e:
        print(f"muse-spark: error: {e}", file=sys.stderr)
        return 2
