"""The Triton python-backend model (``TritonPythonModel``) serving one engine.

``muse-spark triton-repo`` copies this file to ``REPO/<model>/1/model.py``; it
only ever runs inside Triton's python stub (it imports
``triton_python_backend_utils``, which exists nowhere else). The stub runs the
interpreter that launched ``muse-spark serve``, so ``muse_spark`` and torch
import from the same environment (see ``server.py``).

The model is *decoupled*: ``execute`` parses each request, hands it to the
scheduler thread (``scheduler.py``) and returns at once; responses are sent
from the scheduler thread — one per speculative step for ``stream=true``, one
final response otherwise. Bad requests get an INVALID_ARG error response and
touch nothing else. ``config.pbtxt`` parameters: ``engine_dir`` (required),
``device`` (optional override of the engine's device), ``max_queue``, ``prefix_cache_mib``
(memory for stored prompt prefixes, ``runtime/prefix_cache.py``; 0: none),
``torch_threads`` (CPU threads of this instance; default torch's), ``kv_cache_tokens`` or
``kv_cache_memory_fraction``, and ``kv_block_size`` (paged KV caches, ``runtime/kv_blocks.py``; eager engines),
``swap_space`` (GiB of host memory for the K/V of preempted requests; default 4).

Shutdown: ``muse-spark serve`` names a file in ``MUSE_SPARK_SERVE_DRAIN_FILE`` (``options.serve_drain_file``)
and writes the grace period (seconds) into it when it is asked to stop; a
watcher thread then drains the scheduler (``Scheduler.drain``), so every request
gets its final response before tritonserver unloads the model.

numpy: the python backend stub of ``nvidia-pytriton`` is built for numpy 1.x
and corrupts every tensor under numpy 2 (``stub_env.py`` says how); the model
refuses to load there rather than serve wrong tokens. ``muse-spark serve`` runs
the stub with numpy 1.x even where the environment has numpy 2.

Metrics (on Triton's metrics endpoint, labelled by model and instance):
``muse_spark_requests_total{outcome=completed|rejected|cancelled|failed}``,
``muse_spark_generated_tokens_total``, ``muse_spark_steps_total``,
``muse_spark_accepted_draft_tokens_total`` (accepted / steps = mean accepted
length − 1), and the gauges ``muse_spark_active_requests``,
``muse_spark_waiting_requests``, ``muse_spark_free_slots``.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from muse_spark.options import serve_drain_file
from muse_spark.runtime import RequestError, load_engine, load_tokenizer
from muse_spark.serving.protocol import StreamDecoder, parse_request, response_arrays
from muse_spark.serving.scheduler import Scheduler

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _log(msg: str, error: bool = False) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is None:
        print(msg, flush=True)
    elif error:
        logger.log_error(msg)
    else:
        logger.log_info(msg)


def _error(message: str, kind: str):
    # This python backend does not pass an error's code on to the client (HTTP answers 400, gRPC gives no
    # status), so the kind also leads the message: the HTTP front answers "unavailable: …" with 503.
    if kind == "unavailable":
        message = f"unavailable: {message}"
    codes = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "cancelled": "CANCELLED", "internal": "INTERNAL"}
    code = getattr(pb_utils.TritonError, codes.get(kind, "INTERNAL"), None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class _Sequences:
    """The sequences of one request (``num_return_sequences``): they share its response sender, and
    Triton's final flag goes with the response of the last one to end. One that fails ends the others
    (the scheduler sees them cancelled)."""

    def __init__(self, n: int):
        self.left, self.failed, self.lock = n, False, threading.Lock()

    def end(self) -> bool:
        """One sequence has ended → whether it was the last."""
        with self.lock:
            self.left -= 1
            return self.left == 0


class _ResponseSink:
    """Turns one sequence's tokens into Triton responses (called from the scheduler's responder thread, with
    snapshots of the request: ``serving/scheduler.py``)."""

    off_thread = True

    def __init__(self, sender, stream: bool, tokenizer, gamma: int, index: int = 0, group: _Sequences | None = None):
        self.sender, self.stream, self.gamma = sender, stream, gamma
        self.index, self.group = index, group or _Sequences(1)
        self.decoder = StreamDecoder(tokenizer)

    def deliver(self, req, new_tokens: list[int]) -> None:
        if not self.stream and not req.finished:
            return  # a non-streamed sequence gets one final response
        last = req.finished and self.group.end()
        flags = FINAL if last else 0
        if req.finished and self.group.failed:  # (ended because another sequence failed: that one answered)
            if last:
                self.sender.send(flags=FINAL)
            return
        if self.stream:
            ids, text = new_tokens, self.decoder.push(req.output, final=req.finished)
        else:
            ids = list(req.output)
            text = self.decoder.full(ids)
        log_probs = None
        if req.params.logprobs is not None:  # (return_log_probs: the logprobs of these ids, the last of the output)
            start = len(req.output) - len(ids)
            log_probs = [lp for lp, _ in req.logprobs[start:len(req.output)]]
        arrays = response_arrays(ids, text, req.finish_reason if req.finished else None, req.stats(self.gamma),
                                 log_probs, self.index)
        response = pb_utils.InferenceResponse([pb_utils.Tensor(name, a) for name, a in arrays.items()])
        try:
            self.sender.send(response, flags=flags)
        except Exception:
            if last:  # still close the request so Triton can release it
                try:
                    self.sender.send(flags=FINAL)
                except Exception:
                    pass
            raise

    def fail(self, message: str, kind: str) -> None:
        already, self.group.failed = self.group.failed, True
        last = self.group.end()
        if already and kind == "cancelled":  # (ended because another sequence failed: that one answered)
            if last:
                self.sender.send(flags=FINAL)
            return
        self.sender.send(pb_utils.InferenceResponse(error=_error(message, kind)), flags=FINAL if last else 0)

    def cancelled(self) -> bool:
        return self.group.failed or self.sender.is_cancelled()


class _Metrics:
    """Custom Prometheus metrics; updated from the scheduler thread when they change."""

    OUTCOMES = ("completed", "rejected", "cancelled", "failed")

    def __init__(self, model: str, instance: str):
        labels = {"model": model, "instance": instance}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE

        def family(name, doc, kind):
            f = pb_utils.MetricFamily(name=name, description=doc, kind=kind)
            self._families.append(f)
            return f

        self._families: list = []
        req = family("muse_spark_requests_total", "Requests by outcome: completed, rejected, cancelled, failed",
                     counter)
        self.outcomes = {o: req.Metric(labels={**labels, "outcome": o}) for o in self.OUTCOMES}
        self.counters = {
            "generated_tokens": family("muse_spark_generated_tokens_total", "Tokens generated", counter),
            "steps": family("muse_spark_steps_total", "Per-request speculative steps", counter),
            "accepted_draft_tokens": family("muse_spark_accepted_draft_tokens_total", "Draft tokens accepted",
                                            counter),
            "verified_draft_tokens": family("muse_spark_verified_draft_tokens_total",
                                            "Draft tokens sent to the target (gamma a step unless a confidence "
                                            "schedule verifies fewer)", counter),
        }
        self.counters = {k: f.Metric(labels=labels) for k, f in self.counters.items()}
        self.gauges = {
            "active": family("muse_spark_active_requests", "Requests holding a slot", gauge),
            "waiting": family("muse_spark_waiting_requests", "Requests waiting for a slot", gauge),
            "free_slots": family("muse_spark_free_slots", "Free request slots", gauge),
        }
        self.gauges = {k: f.Metric(labels=labels) for k, f in self.gauges.items()}
        self._last: dict[str, float] = {}

    def update(self, counters, occupancy) -> None:
        totals = {**{f"outcome:{o}": counters.outcomes[o] for o in self.OUTCOMES},
                  "generated_tokens": counters.generated_tokens, "steps": counters.steps,
                  "accepted_draft_tokens": counters.accepted_draft_tokens,
                  "verified_draft_tokens": counters.verified_draft_tokens}
        for key, value in totals.items():
            delta = value - self._last.get(key, 0)
            if delta:
                metric = self.outcomes[key[8:]] if key.startswith("outcome:") else self.counters[key]
                metric.increment(delta)
                self._last[key] = value
        for key in ("active", "waiting", "free_slots"):
            value = getattr(occupancy, key)
            if self._last.get(key) != value:
                self.gauges[key].set(value)
                self._last[key] = value

    def close(self) -> None:
        # Metrics must go before their families (the python backend insists).
        self.outcomes.clear()
        self.counters.clear()
        self.gauges.clear()
        self._families.clear()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if int(np.__version__.split(".", 1)[0]) >= 2:
            raise pb_utils.TritonModelException(
                f"muse_spark: this python backend stub was built for numpy 1.x and, under numpy "
                f"{np.__version__}, corrupts every tensor (it reads each dtype's item size as 0); start the "
                f"server with `muse-spark serve`, which runs the stub with numpy 1.x, or install numpy<2")
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "muse_spark: config.pbtxt must set model_transaction_policy { decoupled: true }")
        engine_dir = params.get("engine_dir")
        if not engine_dir:
            raise pb_utils.TritonModelException("muse_spark: config.pbtxt lacks the engine_dir parameter")
        device = params.get("device") or None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        if params.get("torch_threads"):
            import torch

            torch.set_num_threads(int(params["torch_threads"]))
        self.name = args["model_name"]
        tp = int(params.get("tp") or 1)
        if tp > 1:  # rank 0 of a rank set whose other ranks `muse-spark serve` started (triton-repo --tp)
            from muse_spark.options import SERVE_TP_PORT_ENV, serve_tp_port
            from muse_spark.runtime.tensor_parallel import join_as_leader

            port = serve_tp_port()
            if port is None:
                raise pb_utils.TritonModelException(
                    f"muse_spark: this model splits its engine over {tp} ranks; start it with `muse-spark serve`, "
                    f"which starts the other ranks ({SERVE_TP_PORT_ENV} is not set)")
            self.engine = join_as_leader(engine_dir, tp, port, device=device or "cpu")
            self.engine.keepalive()
        else:
            pool = {"kv_block_size": int(params.get("kv_block_size") or 16)}
            if params.get("kv_cache_tokens"):
                pool["kv_tokens"] = int(params["kv_cache_tokens"])
            elif params.get("kv_cache_memory_fraction"):
                pool["kv_memory_fraction"] = float(params["kv_cache_memory_fraction"])
            else:
                pool = {}
            if params.get("swap_space"):
                pool["swap_space"] = float(params["swap_space"])
            self.engine = load_engine(engine_dir, device=device, **pool)
        self.tokenizer = load_tokenizer(self.engine.tokenizer_path)
        self.metrics = None
        if hasattr(pb_utils, "MetricFamily"):
            self.metrics = _Metrics(self.name, args["model_instance_name"])
        self.scheduler = Scheduler(self.engine, max_queue=int(params.get("max_queue") or 256),
                                   prefix_cache_bytes=int(float(params.get("prefix_cache_mib") or 0) * 2**20),
                                   on_change=self.metrics.update if self.metrics else None,
                                   log=lambda m: _log(m, error=True))
        self.scheduler.start()
        if self.metrics is not None:
            self.metrics.update(self.scheduler.counters, self.scheduler.occupancy)  # free slots from the start
        self._stop_watch = threading.Event()
        drain_file = serve_drain_file()
        if drain_file:
            threading.Thread(target=self._watch_drain, args=(drain_file,), daemon=True,
                             name="muse-spark-drain").start()
        e = self.engine
        _log(f"muse_spark: {args['model_instance_name']} serves engine {engine_dir} (γ={e.gamma}, "
             f"max_batch={e.max_batch}, max_seq={e.max_seq}, device={e.device}, "
             f"tokenizer={'yes' if self.tokenizer else 'no'})"
             + (f"; {e.kv_description()}" if hasattr(e, "kv_description") else ""))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(lambda name: _input(request, name), self.tokenizer,
                                       parameters=request.parameters())
            except RequestError as e:
                self.scheduler.reject(_ResponseSink(sender, False, None, 0), str(e))
                continue
            except Exception as e:  # a parsing bug: this request fails, the others go on
                _log(f"muse_spark: cannot parse a request: {type(e).__name__}: {e}", error=True)
                self.scheduler.reject(_ResponseSink(sender, False, None, 0), f"bad request: {e}", kind="internal")
                continue
            group = _Sequences(parsed.n)
            for i in range(parsed.n):  # (num_return_sequences: the first prefills the prompt, the others copy it)
                sink = _ResponseSink(sender, parsed.stream, self.tokenizer, self.engine.gamma, i, group)
                self.scheduler.submit(parsed.prompt, parsed.sequence_params(i), sink)
        return None  # decoupled: the responses go through the senders

    def _watch_drain(self, path: str) -> None:
        while not self._stop_watch.wait(0.05):
            try:
                with open(path) as f:
                    grace = float(f.read().strip() or 0)
            except (OSError, ValueError):
                continue
            _log(f"muse_spark: draining: running requests may go on for {grace:g} s")
            self.scheduler.drain(grace)
            return

    def finalize(self) -> None:
        self._stop_watch.set()
        self.scheduler.stop()
        if hasattr(self.engine, "keepalive"):  # (a rank set's leader: its followers end)
            self.engine.close()
        if self.metrics is not None:
            self.metrics.close()


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
