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
goes to the next request in the same step — and hands the text (and, where
asked for, the log-probabilities of the tokens now out) to the request's
handler on the event loop. ``n`` > 1 choices are ``n`` scheduler requests of
one prompt, with seeds seed, seed + 1, …, each with its own sink feeding the
one handler (``_Answer``); they do not share the prompt's prefill. A client
that goes away (mid-stream, or while a non-streamed request waits) marks its
answer gone; the scheduler then cancels its requests and frees their slots.

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

from muse_spark.serving.server import ServingError, _port, _positive, _seconds, add_kv_pool_arguments, kv_pool
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
                 max_queue: int = 256, log=_log, engine=None, prefix_cache_mib: float = 0, kv_pool: dict | None = None):
        # (torch and the runtime load here, when a server is made, not when the CLI parses its arguments)
        from muse_spark.engine_format import read_manifest
        from muse_spark.runtime import load_engine, load_tokenizer
        from muse_spark.serving.openai_protocol import ServedModel, TokenText
        from muse_spark.serving.scheduler import Scheduler

        engine_dir = Path(engine_dir)
        # (``engine``: one already loaded — rank 0's LeaderEngine of a tensor-parallel rank set)
        self.engine = engine if engine is not None else load_engine(engine_dir, device=device, **(kv_pool or {}))
        manifest = read_manifest(engine_dir)
        self.created = _epoch(manifest.get("created"))
        tokenizer = load_tokenizer(self.engine.tokenizer_path)
        template = chat_template(engine_dir, manifest)
        self.scheduler = Scheduler(self.engine, max_queue=max_queue, log=log,
                                   prefix_cache_bytes=int(prefix_cache_mib * 2**20))
        name = served_model_name or engine_dir.resolve().name
        self.served = ServedModel(name, self.scheduler.gen, tokenizer, template, self.engine.max_seq,
                                  self.engine.gamma)
        self.token_text = TokenText(tokenizer)  # (log-probabilities: each token's text and bytes)
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


# ---- one request: the scheduler's sinks and the handler's events -----------------------------
@dataclass(frozen=True)
class _Text:
    """New text of one choice (``finished``: its last, with its finish reason and token counts);
    ``logprobs``: the tokens now out, (token, logprob, top [(token, logprob)], text offset), or None
    where none were asked for."""
    index: int
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None


@dataclass(frozen=True)
class _Failure:
    message: str
    kind: str  # 'invalid' | 'unavailable' | 'cancelled' | 'internal' (the scheduler's kinds)
    index: int = 0

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


class _Answer:
    """The events of one HTTP request's choices (each a request of its own to the scheduler), for the
    handler on the event loop. ``gone``: the client went away (or the answer ended early), so the
    scheduler cancels the choices still running; ``done``: the handler has every choice's last event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: deque = deque()
        self.ready = asyncio.Event()
        self.gone = False
        self.done = False

    def push_threadsafe(self, event) -> None:
        self.loop.call_soon_threadsafe(self._push, event)  # (raises once the loop is gone: the client is)

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


class _Sink:
    """The scheduler's sink of one choice (``scheduler.Sink``); its events go to the answer's loop."""

    def __init__(self, answer: _Answer, index: int, service: OpenAIService, text, stream: bool):
        self.answer, self.index, self.service, self.text, self.stream = answer, index, service, text, stream
        self.reported = 0  # tokens whose log-probabilities went out

    # -- the scheduler thread's side --
    def deliver(self, req, new_tokens: list[int]) -> None:
        text = self.text
        if self.stream or text.per_token or req.finished:
            text.feed(req.output, final=req.finished)
            if text.stopped and not req.finished:
                # A stop string: end the request now (the scheduler sees it finished and frees its slot).
                self.service.scheduler.gen.cancel(req, "stop")
        if not req.finished and not self.stream:
            return  # a non-streamed request gets one answer
        if req.finished and req.finish_reason in ("stop", "length"):
            self.service.stats.add(req)
        piece = text.take(final=req.finished)
        logprobs = None
        if text.offsets is not None:
            end = min(text.reportable(req.finished), len(req.logprobs))
            logprobs = [(req.output[k], *req.logprobs[k], text.offsets[k]) for k in range(self.reported, end)]
            self.reported = max(self.reported, end)
        self.answer.push_threadsafe(_Text(self.index, piece, req.finished,
                                          req.finish_reason if req.finished else None, len(req.prompt),
                                          text.tokens if text.stopped else len(req.output), logprobs))

    def fail(self, message: str, kind: str) -> None:
        self.answer.push_threadsafe(_Failure(message, kind, self.index))

    def cancelled(self) -> bool:
        return self.answer.gone


class _Shape:
    """The JSON of one request's answer: a completion or a chat completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool, tokens=None, logprobs: bool = False):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.tokens, self.logprobs = tokens, logprobs  # (a TokenText, where log-probabilities were asked for)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(evs: list[_Text]) -> dict:
        """The prompt once (every choice has the same), the completion tokens of all choices."""
        prompt, completion = evs[0].prompt_tokens, sum(ev.completion_tokens for ev in evs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, entries) -> dict | None:
        from muse_spark.serving.openai_protocol import chat_logprobs, completion_logprobs

        if not self.logprobs:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(entries or [], self.tokens)

    def response(self, evs: list[_Text]) -> dict:
        """The whole answer of the choices' last events (in index order)."""
        if self.chat:
            choices = [{"index": ev.index, "message": {"role": "assistant", "content": ev.text},
                        "logprobs": self._logprobs(ev.logprobs), "finish_reason": ev.finish_reason} for ev in evs]
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage(evs)}
        choices = [{"index": ev.index, "text": ev.text, "logprobs": self._logprobs(ev.logprobs),
                    "finish_reason": ev.finish_reason} for ev in evs]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage(evs)}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs=None, *, role: bool = False) -> dict:
        lp = self._logprobs(logprobs) if logprobs is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, evs: list[_Text]) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(evs)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(answer: _Answer, shape: _Shape, first, n: int):
    """The event stream of a running request's ``n`` choices (its first event already came), their
    chunks in the order the steps produce them; ``answer.done`` once every choice's last event is out
    (an error ends the stream: the choices still running are then cancelled)."""
    ev, last = first, {}
    if shape.chat:
        for i in range(n):
            yield _sse(shape.chunk(i, "", None, role=True))
    while True:
        if isinstance(ev, _Failure):
            yield _sse(ev.error().body())
            break
        if ev.text or ev.logprobs or ev.finished:
            yield _sse(shape.chunk(ev.index, ev.text, ev.finish_reason, ev.logprobs))
        if ev.finished:
            last[ev.index] = ev
            if len(last) == n:
                if shape.include_usage:
                    yield _sse(shape.usage_chunk([last[i] for i in range(n)]))
                answer.done = True
                break
        ev = await answer.next()
    answer.gone = not answer.done
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
        """An event stream whose choices are cancelled when the response ends before their last event
        (the client went away: mid-stream, or before the stream began)."""

        def __init__(self, answer: _Answer, shape: _Shape, first, n: int):
            super().__init__(_events(answer, shape, first, n), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.answer = answer

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                if not self.answer.done:
                    self.answer.gone = True

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
        logprobs = parsed.params.logprobs is not None
        shape = _Shape(chat, service.served.name, parsed.include_usage, service.token_text, logprobs)
        answer = _Answer(asyncio.get_running_loop())
        for i in range(parsed.n):  # (n requests: the first prefills the prompt, the others copy its chunks)
            text = TextStream(service.served.tokenizer, parsed.stop, offsets=logprobs)
            service.scheduler.submit(parsed.prompt, parsed.choice_params(i), _Sink(answer, i, service, text,
                                                                                    parsed.stream))
        streaming = False
        try:
            first = await answer.next(request)
            if isinstance(first, _Failure):
                raise first.error()
            if not parsed.stream:
                last = {}
                ev = first
                while True:
                    if isinstance(ev, _Failure):
                        raise ev.error()
                    last[ev.index] = ev
                    if len(last) == parsed.n:
                        break
                    ev = await answer.next(request)
                answer.done = True
                return JSONResponse(shape.response([last[i] for i in range(parsed.n)]))
            # a choice refused at once (the queue full, say) fails the whole request before it streams
            refused = next((e for e in answer.events if isinstance(e, _Failure)), None)
            if refused is not None:
                raise refused.error()
            streaming = True
            return EventStream(answer, shape, first, parsed.n)
        except _Disconnected:
            return Response(status_code=499)  # (nobody reads it)
        finally:
            if not streaming and not answer.done:
                answer.gone = True  # (cancels the choices still running: the client went away, or one failed)

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
    family("muse_spark_verified_draft_tokens_total", "counter",
           "Draft tokens sent to the target (gamma a step unless a confidence schedule verifies fewer)",
           [("", c.verified_draft_tokens)])
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
                 max_queue: int = 256, exit_timeout: float = 10.0, log_level: str = "info", engine=None,
                 prefix_cache_mib: float = 0, kv_pool: dict | None = None) -> int:
    """Load the engine (or take ``engine``), then serve on ``host:port`` until SIGINT/SIGTERM (which
    drains: see the module doc)."""
    try:
        import uvicorn
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError as e:
        raise ServingError(f"{e.name} is not installed; {OPENAI_EXTRA_HINT}") from None
    if port_in_use(host, port):
        raise ServingError(f"the port {host}:{port} is in use; choose another with --port")
    service = OpenAIService(engine_dir, served_model_name=served_model_name, device=device, max_queue=max_queue,
                            engine=engine, prefix_cache_mib=prefix_cache_mib, kv_pool=kv_pool)
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
         f"{'yes' if service.served.chat_template else 'no'})"
         + (f"; {e.kv_description()}" if hasattr(e, "kv_description") else ""))
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
    s.add_argument("--prefix-cache-mib", type=float, default=0,
                   help="memory (MiB) for stored prompt prefixes: a request starting with one (a shared system "
                        "prompt) skips its prefill (default 0: none)")
    s.add_argument("--tp", type=_positive, default=None, metavar="N",
                   help="split the target across N ranks (an eager engine; processes: gloo on CPU, NCCL on CUDA). "
                        "Default: the ranks the engine was built for (build --tp N), else 1")
    add_kv_pool_arguments(s)
    s.set_defaults(fn=cmd_serve_openai)


def _serve_lead(leader, **kw) -> int:
    """Rank 0 of a tensor-parallel rank set: the server over its LeaderEngine (kept alive while idle)."""
    leader.keepalive()
    return serve_openai(engine=leader, **kw)


def cmd_serve_openai(a: argparse.Namespace) -> int:
    kw = dict(engine_dir=a.engine, host=a.host, port=a.port, served_model_name=a.served_model_name, device=a.device,
              max_request_bytes=a.max_request_bytes, max_queue=a.max_queue, exit_timeout=a.exit_timeout,
              log_level=a.log_level, prefix_cache_mib=a.prefix_cache_mib, kv_pool=kv_pool(a))
    try:
        if a.prefix_cache_mib < 0:
            raise ServingError(f"--prefix-cache-mib must be >= 0, got {a.prefix_cache_mib}")
        if a.tp is None:  # (an engine built for ranks is served over them)
            from muse_spark.engine_format import built_world

            a.tp = built_world(a.engine)
        if a.tp > 1:
            import functools

            from muse_spark.runtime import tensor_parallel as tp

            from muse_spark.engine_format import EngineError, read_manifest
            from muse_spark.sharding import check_engine_split

            if port_in_use(a.host, a.port):  # (before the ranks load)
                raise ServingError(f"the port {a.host}:{a.port} is in use; choose another with --port")
            try:
                check_engine_split(read_manifest(a.engine), a.tp, a.engine)
            except EngineError as e:
                raise ServingError(str(e)) from None
            except tp.TensorParallelError as e:
                raise ServingError(str(e)) from None
            try:
                return tp.launch(a.tp, tp.lead_or_follow, a.engine, None, functools.partial(_serve_lead, **kw),
                                 a.device or "cpu", device=a.device or "cpu")
            except tp.TensorParallelError as e:
                raise ServingError(str(e)) from None
        return serve_openai(**kw)
    except ServingError as e:
        print(f"muse-spark: error: {e}", file=sys.stderr)
        return 2
