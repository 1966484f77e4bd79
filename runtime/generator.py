"""Request scheduling, in-flight batching and streaming over an engine.

``Generator`` owns the request slots of one engine. Requests are validated
when they are added (a bad request raises ``RequestError`` and touches no
cache), are prefilled when they join, and share every speculative step with
the other active requests; they leave as soon as they finish, freeing their
slot. Each step costs one device→host copy (draft tokens, accepted counts,
bonus tokens), from which the host emits tokens, clipped at stop tokens and
``max_tokens``.

Thread safety: one ``Generator`` may be shared by several threads. Every public
method that reads or changes its requests (``add``, ``cancel``, ``has_work``,
``step``, ``run``, ``generate``, ``stream``/``iter_request``) holds the
generator's re-entrant lock, so concurrent callers take turns step by step and
every request gets exactly the tokens it gets alone. ``iter_request`` takes the
lock for each step, never across a ``yield``; ``generate`` takes it for each
step too, so the requests of several threads share the steps (in-flight
batching) instead of waiting for each other's whole runs. A single driving
thread (the Triton scheduler) pays one uncontended lock acquire per call.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from muse_spark.runtime.engine import PrefillChunk
from muse_spark.runtime.kv_blocks import SWAP_SPACE_GIB, swap_space_bytes
from muse_spark.runtime.prefix_cache import chunk_keys


GREEDY_BELOW = 1e-5


class RequestError(ValueError):
    """A request that cannot be served; nothing was allocated or run for it."""


MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_TOKENS = 16, 64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # token sequences that end the output (kept in it, as a stop token is) once it ends with one of them,
    # across step boundaries: tensorrtllm_backend's multi-token stop words
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    # Sampling controls on the target's distribution (plugins/acceptance/processing.py; the eager
    # engine): the defaults change nothing.
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the most likely tokens up to this mass
    min_p: float = 0.0  # drop tokens below min_p × the most likely one's probability
    repetition_penalty: float = 1.0  # prompt and output tokens: z/r where z > 0, z·r elsewhere
    presence_penalty: float = 0.0  # output tokens: − p once a token is out
    frequency_penalty: float = 0.0  # output tokens: − f × its count
    min_tokens: int = 0  # stop tokens are held back until this many tokens are out
    logprobs: int | None = None  # the emitted tokens' log-probabilities, and the top N at each (0: none)

    def controls(self) -> bool:
        """Whether any sampling control or logprobs is asked for."""
        return (self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
                self.frequency_penalty, self.min_tokens, self.logprobs) != (0, 1.0, 0.0, 1.0, 0.0, 0.0, 0, None)


@dataclass
class StepRecord:
    position: int  # the anchor's position
    draft_ids: list[int]
    accepted: int
    emitted: list[int]
    confidence: list[float] | None = None  # the confidence head's value per draft, where the engine reports it
    verified: int | None = None  # drafts sent to the target (None: all γ; the schedule 'off')


@dataclass(frozen=True)
class StepTotals:
    """What ``Request.stats`` sums over a request's steps, kept as they are appended (``add``), so that a
    server reporting the statistics with every streamed response pays O(γ) a response, not O(steps).
    Immutable: a snapshot of the request (``serving/scheduler.py``) shares it with no one writing it."""

    n: int = 0  # steps counted
    gamma: int = 0
    accepted: int = 0
    emitted: int = 0
    verified: int = 0
    per_position: tuple[int, ...] = ()  # steps whose accepted run reached past each draft position
    yes: tuple[float, int] = (0.0, 0)  # the confidences (sum, count) at decided positions where the draft was accepted
    no: tuple[float, int] = (0.0, 0)  # … and where it was rejected

    def add(self, step: StepRecord, gamma: int) -> "StepTotals":
        per = self.per_position or (0,) * gamma
        yes, no = decided_confidences([step], gamma)
        return StepTotals(self.n + 1, gamma, self.accepted + step.accepted, self.emitted + len(step.emitted),
                          self.verified + (gamma if step.verified is None else step.verified),
                          tuple(c + (step.accepted > k) for k, c in enumerate(per)),
                          (self.yes[0] + sum(yes), self.yes[1] + len(yes)), (self.no[0] + sum(no), self.no[1] + len(no)))

    @classmethod
    def of(cls, steps: list[StepRecord], gamma: int) -> "StepTotals":
        totals = cls()
        for step in steps:
            totals = totals.add(step, gamma)
        return totals


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    slot: int = -1
    output: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    anchor: int = -1
    position: int = -1  # the anchor's position (tokens before it are cached)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | cancelled | error (or the reason given to cancel)
    error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    pending: list[int] = field(default_factory=list)  # emitted, not yet streamed
    logprobs: list[tuple] = field(default_factory=list)  # per output token (SamplingParams.logprobs): (lp, top)
    prefilled: int = 0  # tokens of ``Generator._sequence`` prefilled so far (while in ``Generator.prefilling``)
    swapped: tuple | None = field(default=None, repr=False)  # a preempted request's K/V (``EagerEngine.swap_out``)
    # preempted by recompute (past the swap space): its prompt and emitted tokens are prefilled again, then it
    # steps on from its anchor
    recompute: bool = False
    block_keys: list[bytes] | None = field(default=None, repr=False)  # (``Generator._block_keys``)
    preempted: int = 0  # times the request gave its KV blocks up for another (paged caches)
    chunk_keys: list[bytes] | None = field(default=None, repr=False)  # (``Generator._keys``)
    totals: StepTotals = field(default_factory=StepTotals, repr=False)  # ``steps`` summed (``add_step``)

    def add_step(self, step: StepRecord, gamma: int) -> None:
        """Append ``step`` and count it in ``totals``."""
        self.steps.append(step)
        self.totals = self.totals.add(step, gamma)

    @classmethod
    def ended(cls, prompt: list[int], params: SamplingParams | None, reason: str) -> Request:
        """A request that never ran, already finished with ``reason`` and no tokens (the final answer
        for one a server ends before it is queued)."""
        now = time.perf_counter()
        return cls(-1, list(prompt) if isinstance(prompt, (list, tuple)) else [],
                   params if isinstance(params, SamplingParams) else SamplingParams(), frozenset(),
                   finished=True, finish_reason=reason, t_start=now, t_end=now)

    def stats(self, gamma: int) -> dict:
        t = self.totals
        if t.n != len(self.steps) or (t.n and t.gamma != gamma):  # (steps appended elsewhere, or another γ)
            t = StepTotals.of(self.steps, gamma)
        n = t.n
        secs = max(self.t_end - self.t_start, 1e-9)
        return {
            "steps": n,
            "generated_tokens": len(self.output),
            "accepted_draft_tokens": t.accepted,
            "mean_accepted_per_step": t.accepted / n if n else 0.0,
            "mean_emitted_per_step": t.emitted / n if n else 0.0,
            "acceptance_per_position": [c / n for c in t.per_position] if n else [0.0] * gamma,
            # drafts sent to the target per step (γ unless a confidence schedule verified fewer)
            "mean_verified_per_step": t.verified / n if n else 0.0,
            "tokens_per_second": len(self.output) / secs,
            "seconds": secs,
            "finish_reason": self.finish_reason,
            **({"confidence": _confidence_totals(t.yes, t.no)} if t.yes[1] or t.no[1] else {}),
        }


def decided_confidences(steps: list[StepRecord], gamma: int) -> tuple[list[float], list[float]]:
    """The confidence head's values at the decided draft positions of ``steps`` (positions ``0 …
    accepted``: every draft before them accepted), split into the accepted and the rejected ones; steps
    without confidences (compiled engines) count for nothing."""
    yes, no = [], []
    for s in steps:
        if s.confidence is None:
            continue
        for k in range(min(s.accepted + 1, gamma)):
            (yes if k < s.accepted else no).append(s.confidence[k])
    return yes, no


def _confidence_totals(yes: tuple[float, int], no: tuple[float, int]) -> dict:
    """``confidence_figures`` from (sum, count) of each side."""
    return {"decided_positions": yes[1] + no[1], "mean_when_accepted": yes[0] / yes[1] if yes[1] else None,
            "mean_when_rejected": no[0] / no[1] if no[1] else None}


def confidence_figures(yes: list[float], no: list[float]) -> dict:
    """The head's calibration from ``decided_confidences``: how many positions, its mean value where the
    draft was accepted and where it was rejected."""
    return {"decided_positions": len(yes) + len(no), "mean_when_accepted": sum(yes) / len(yes) if yes else None,
            "mean_when_rejected": sum(no) / len(no) if no else None}


class Generator:
    """Request slots, scheduling and streaming over one engine.

    Safe to share between threads: a re-entrant lock serializes ``add``, ``cancel``,
    ``has_work``, ``step``, ``run`` and each step that ``generate`` and ``stream``/``iter_request``
    take (never held across a ``yield``), so concurrent callers interleave at step boundaries and
    each request's tokens are exactly those it gets alone. The lists ``waiting``, ``prefilling``,
    ``active`` and ``free_slots`` are the generator's state: read them under ``with gen.lock:`` when other
    threads drive it. ``generate`` is all-or-nothing: it checks every prompt and its params
    before it queues any, so a ``RequestError`` leaves the generator as it was."""

    def __init__(self, engine, prefill_budget: int | None = None, prefix_cache=None):
        self.engine = engine
        self.gamma = engine.gamma
        self.free_slots = list(range(engine.max_batch))[::-1]
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []  # holding a slot, their prompts part-way through prefill
        self.active: list[Request] = []
        # prompt tokens a scheduler iteration prefills (at least one chunk): what a step may wait for
        self.prefill_budget = prefill_budget if prefill_budget is not None else 2 * engine.prefill_chunk
        # stored prompt prefixes (runtime/prefix_cache.py): a request starting with one prefills after it
        self.prefix_cache = prefix_cache
        # Prompt chunks a live request has prefilled are copied into a request whose prompt starts the
        # same (``_share_prefill``, through ``engine.copy_positions``: on a tensor-parallel rank set every
        # rank copies): n samples of one prompt, or one system prompt sent at once, prefill it once.
        self.share_prefill = hasattr(engine, "copy_positions")
        self.shared_prefill_tokens = 0  # prompt tokens copied from another request's slot, not prefilled
        # an engine that keeps the sampling controls on the device per slot (aoti) gets each request's
        # controls once, when its prefill ends, and its controlled steps run unchained
        self._stateful_controls = bool(getattr(engine, "stateful_controls", False) and getattr(engine, "controls",
                                                                                             False))
        self._ids = itertools.count()
        self.vocab = engine.tcfg.vocab_size
        self.eos = frozenset(engine.tcfg.eos_token_id)
        self.step_times: list[float] = []
        self._inflight = None  # (handle, batch): a chained step launched, its rows not read yet
        # paged KV caches (runtime/kv_blocks.py): requests are admitted while the pool has blocks for them,
        # and the newest is preempted when the running ones outgrow it
        self.paged = getattr(engine, "kv", None) is not None
        self.preemptions = 0
        # A running request preempted is swapped out (its K/V copied to host memory) while the copies of the
        # requests swapped out stay within the engine's swap space (``swap_space``, bytes here), and preempted
        # by recompute past it (``_preempt``): ``swapped_bytes`` is what they hold, ``swapped_bytes_peak`` the most
        # they held, ``recomputations`` the preemptions by recompute.
        self.swap_space = getattr(engine, "swap_space_bytes", None)
        if self.swap_space is None:  # (an engine without paged caches: the default, never used)
            self.swap_space = swap_space_bytes(SWAP_SPACE_GIB)
        self.swapped_bytes = self.swapped_bytes_peak = 0
        self.recomputations = 0
        # ... and their prompts' full blocks are shared by reference, where a prefill chunk is whole blocks
        # (a request resumes its prefill at a chunk boundary: the same chunks, the same values)
        self.share_blocks = self.paged and engine.prefill_chunk % engine.kv.block_size == 0
        self.cached_prefill_tokens = 0  # prompt tokens whose blocks a request mapped in, not prefilled
        self.lock = threading.RLock()  # held by every public method that reads or changes the requests

    # ---- validation ------------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"a prompt must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise RequestError("the prompt is empty")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        not_int = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if not_int:
            raise RequestError(f"prompt token ids must be integers, got {type(not_int[0]).__name__} {not_int[0]!r}")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})")
        if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {params.max_tokens!r}")
        t = params.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or math.isnan(t) or math.isinf(t) or t < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(params.seed, int) or not -(2**63) <= params.seed < 2**64:
            raise RequestError(f"seed must be a 64-bit integer, got {params.seed!r}")
        self._validate_controls(params)
        bad_stop = [s for s in params.stop_token_ids if not isinstance(s, int) or not 0 <= s < self.vocab]
        if bad_stop:
            raise RequestError(f"stop token ids {bad_stop[:5]} are outside the vocabulary [0, {self.vocab})")
        seqs = params.stop_sequences
        if not isinstance(seqs, tuple) or len(seqs) > MAX_STOP_SEQUENCES or any(
                not isinstance(q, tuple) or not 1 <= len(q) <= MAX_STOP_SEQUENCE_TOKENS
                or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab for t in q)
                for q in seqs):
            raise RequestError(f"stop sequences must be at most {MAX_STOP_SEQUENCES} tuples of 1 … "
                               f"{MAX_STOP_SEQUENCE_TOKENS} token ids in [0, {self.vocab}), got {seqs!r:.200}")
        need = len(prompt) + params.max_tokens + self.gamma
        if need > self.engine.max_seq:
            raise RequestError(
                f"prompt length {len(prompt)} + max_tokens {params.max_tokens} (+ {self.gamma} draft slots) = "
                f"{need} exceeds the engine's maximum sequence length {self.engine.max_seq}"
            )

    def _validate_controls(self, p: SamplingParams) -> None:
        def number(name, lo, hi, integer=False):
            v = getattr(p, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
                kind = "an integer" if integer else "a number"
                raise RequestError(f"{name} must be {kind} in [{lo}, {hi}], got {v!r}")

        number("top_k", 0, self.vocab, integer=True)
        number("top_p", 0.0, 1.0)
        if p.top_p == 0:
            raise RequestError("top_p must be > 0 (1 keeps every token)")
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", 1e-6, 100.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("min_tokens", 0, p.max_tokens if isinstance(p.max_tokens, int) else 0, integer=True)
        if p.logprobs is not None:
            number("logprobs", 0, 20, integer=True)
        if p.controls() and not getattr(self.engine, "controls", False):
            raise RequestError(f"sampling controls (top_k, top_p, min_p, penalties, min_tokens, logprobs) run on the "
                               f"eager engine and on aoti engines built with their steps; this {self.engine.backend} "
                               "engine samples with temperature and seed only")

    def _controls_row(self, req: Request) -> dict:
        p = req.params
        return {"top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
                "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
                "min_tokens": p.min_tokens, "prompt": req.prompt, "output": req.output, "stop_ids": sorted(req.stop_ids)}

    # ---- requests --------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        """Queue one request (it is prefilled when a slot is free). A bad request raises
        ``RequestError`` and queues nothing."""
        checked = self._check(prompt, params)
        with self.lock:
            return self._enqueue([checked])[0]

    def _check(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams, frozenset[int]]:
        """Validate one request → (its prompt, its normalized params, its stop ids); changes nothing."""
        params = SamplingParams() if params is None else params
        self.validate(prompt, params)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos
        seed = params.seed - 2**64 if params.seed >= 2**63 else params.seed  # stored as int64
        # Temperatures below 1e-5 are greedy (as in vLLM): z/T would overflow fp32.
        temperature = 0.0 if params.temperature < GREEDY_BELOW else float(params.temperature)
        return list(prompt), SamplingParams(**{**params.__dict__, "seed": seed, "temperature": temperature}), \
            frozenset(stop)

    def _enqueue(self, checked: list[tuple[list[int], SamplingParams, frozenset[int]]]) -> list[Request]:
        reqs = [Request(next(self._ids), prompt, params, stop) for prompt, params, stop in checked]
        self.waiting.extend(reqs)
        return reqs

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """End ``req`` now (its slot is freed) with finish reason ``reason``; a finished request stays as it is."""
        with self.lock:
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, reason)

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.prefilling or self.active)

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.finished, req.finish_reason, req.t_end = True, reason, time.perf_counter()
        if req in self.active:
            self.active.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        self._drop_swapped(req)
        req.recompute = False
        if req.slot >= 0:
            self._free_slot(req)

    def _drop_swapped(self, req: Request) -> None:
        """Forget ``req``'s swapped-out copies (put back, or the request ended) and their host bytes."""
        if req.swapped is not None:
            self.swapped_bytes -= self.engine.block_bytes(req.swapped[0].shape[0])
            req.swapped = None

    def _sequence(self, req: Request) -> list[int]:
        """The tokens ``req`` prefills: its prompt; after a preemption by recompute, its prompt and every token
        it emitted but the last (its anchor: the next step starts at its position)."""
        return req.prompt + req.output[:-1] if req.recompute else req.prompt

    def _free_slot(self, req: Request) -> None:
        if self.paged:
            self.engine.kv.release(req.slot)
        self.free_slots.append(req.slot)
        req.slot = -1

    def _emit(self, req: Request, tokens: list[int]) -> list[int]:
        """Append tokens, clipped at the first stop token (kept) and at max_tokens."""
        room = req.params.max_tokens - len(req.output)
        out, seqs, stopped = [], req.params.stop_sequences, False
        for t in tokens[:room]:
            out.append(t)
            if t in req.stop_ids or (seqs and self._ends_a_sequence(req, out)):
                stopped = True
                break
        req.output.extend(out)
        req.pending.extend(out)
        if stopped:
            self._finish(req, "stop")
        elif len(req.output) >= req.params.max_tokens:
            self._finish(req, "length")
        return out

    @staticmethod
    def _ends_a_sequence(req: Request, out: list[int]) -> bool:
        """Whether the output followed by ``out`` ends with one of the request's stop sequences (once
        ``min_tokens`` are out, as stop tokens are held back until then)."""
        n = len(req.output) + len(out)
        if n < req.params.min_tokens:
            return False
        for q in req.params.stop_sequences:
            k = len(q)
            if k <= n and tuple((req.output[n - k:] if k > len(out) else []) + out[-k:]) == q:
                return True
        return False

    # ---- scheduling ------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests take the free slots, in order, and start prefilling (no work yet). On paged
        caches a request also needs blocks for its prompt and first step (a preempted one: for the
        positions it had reached, which it gets back as they were and steps on, or, preempted by recompute,
        prefills again); the first that does not fit waits, and the ones behind it with it."""
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            cached = 0
            if self.paged:
                slot, kv = self.free_slots[-1], self.engine.kv
                if req.swapped is None and self.share_blocks:  # its prompt's blocks already in the pool
                    keys = self._block_keys(req)
                    per_chunk = self.engine.prefill_chunk // kv.block_size
                    cached = kv.cached_run(keys) // per_chunk * per_chunk
                    kv.attach(slot, keys[:cached])
                resumes = req.swapped is not None or req.recompute
                end = (req.position if resumes else len(req.prompt)) + self.gamma + 1
                if not kv.reserve(slot, end):
                    kv.release(slot)
                    return
            self.waiting.pop(0)
            req.slot = self.free_slots.pop()
            if req.swapped is not None:
                self.engine.swap_in(req.slot, req.swapped)
                self._drop_swapped(req)
                if self._stateful_controls:  # (its slot's controls state may be another request's by now)
                    self.engine.set_controls(req.slot, self._controls_row(req))
                self.active.append(req)
                continue
            if not req.t_start:
                req.t_start = time.perf_counter()
            req.prefilled = cached * self.engine.kv.block_size if cached else 0
            self.cached_prefill_tokens += req.prefilled
            if self.prefix_cache is not None and not self.paged:  # (paged: the blocks above, by reference)
                blocks = self.prefix_cache.lookup(req.prompt)
                if blocks:
                    self.prefix_cache.restore(req.prompt, blocks, req.slot)
                    req.prefilled = blocks * self.engine.prefill_chunk
            self.prefilling.append(req)

    def _prefill_round(self) -> list[Request]:
        """One prefill round: the next chunk of each prefilling request, in admission order, while
        the round's token budget (``prefill_budget``) lasts (the first chunk always runs), in one
        engine call (``engine.prefill_chunks``: one forward over the batch on the eager engine). A
        request whose prompt is done emits its first token and joins the speculative steps. An
        engine failure is retried chunk by chunk, so only a request whose own chunk fails ends (with
        finish reason ``error``). → the requests that emitted."""
        C, budget, picked = self.engine.prefill_chunk, self.prefill_budget, []
        for i, req in enumerate(self.prefilling):
            if self.share_prefill and self._share_prefill(req, self.prefilling[:i]):
                continue  # (an earlier request prefills its next chunk this round: copied on the next)
            n = min(C, len(self._sequence(req)) - req.prefilled)
            if picked and n > budget:
                break
            picked.append(req)
            budget -= n
        # (a recomputed request's first token is not used: its controls and logprobs are not asked for)
        chunks = [PrefillChunk(self._sequence(r), r.prefilled, r.slot, r.params.seed, float(r.params.temperature),
                               self._controls_row(r) if r.params.controls() and not r.recompute else None,
                               None if r.recompute else r.params.logprobs)
                  for r in picked]
        try:
            firsts = self.engine.prefill_chunks(chunks)
        except Exception:
            firsts = []
            for req, chunk in zip(picked, chunks):
                try:
                    firsts.extend(self.engine.prefill_chunks([chunk]))
                except Exception as e:  # this request fails alone; its slot is freed
                    req.error = f"{type(e).__name__}: {e}"
                    firsts.append(None)
                    self._finish(req, "error")
        emitted = []
        for req, first in zip(picked, firsts):
            if req.finished:
                if req.finish_reason == "error":
                    emitted.append(req)
                continue
            if self.prefix_cache is not None and not self.paged and req.prefilled + C <= len(req.prompt):
                self.prefix_cache.insert(req.prompt, req.prefilled // C, req.slot)  # (a full chunk: keep it)
            req.prefilled = min(len(self._sequence(req)), req.prefilled + C)
            if self.share_blocks:  # the prompt's blocks written so far, for requests admitted later
                self.engine.kv.register(req.slot, self._block_keys(req)[: req.prefilled // self.engine.kv.block_size])
            if first is None:
                continue
            self.prefilling.remove(req)
            if req.recompute:  # its K/V are back: it steps on from its anchor (the token sampled here is one it emitted)
                req.recompute = False
                self.active.append(req)
                if self._stateful_controls:
                    self.engine.set_controls(req.slot, self._controls_row(req))
                continue
            req.anchor, req.position = int(first.item()), len(req.prompt)
            self.active.append(req)
            if req.params.logprobs is not None:
                req.logprobs.append(self._top(self.engine.take_prefill_logprobs(req.slot), req.params.logprobs))
            self._emit(req, [req.anchor])
            if self._stateful_controls and not req.finished:  # (every request: its slot may hold another's)
                self.engine.set_controls(req.slot, self._controls_row(req))
            emitted.append(req)
        return emitted

    def _block_keys(self, req: Request) -> list[bytes]:
        """Paged caches: the chained keys of the KV blocks ``req``'s prompt fills before its last chunk
        (the blocks a later request may map in; its last chunk it prefills itself)."""
        if req.block_keys is None:
            P, C = self.engine.kv.block_size, self.engine.prefill_chunk
            req.block_keys = chunk_keys(req.prompt, P, (len(req.prompt) - 1) // C * C // P)
        return req.block_keys

    def _keys(self, req: Request) -> list[bytes]:
        """The chained keys of ``req``'s prompt chunks before its last one (``prefix_cache.chunk_keys``):
        the chunks another request can hand it (its last chunk it prefills itself, for its first token)."""
        if req.chunk_keys is None:
            C = self.engine.prefill_chunk
            req.chunk_keys = chunk_keys(req.prompt, C, (len(req.prompt) - 1) // C)
        return req.chunk_keys

    def _share_prefill(self, req: Request, earlier: list[Request]) -> bool:
        """Copy into ``req``'s slot the chunks of its prompt that a live request (holding a slot, its prompt
        the same up to there) has prefilled, and → whether ``req`` should sit this round out: an earlier
        prefilling request shares ``req``'s next chunk and computes it first. Exact: prefill runs in the
        same chunks, so a copied chunk holds the values ``req``'s own prefill would write."""
        C, mine = self.engine.prefill_chunk, self._keys(req)
        done = req.prefilled // C
        if done >= len(mine):
            return False

        def shared(d: Request) -> int:
            theirs, m = self._keys(d), 0
            while m < min(len(mine), len(theirs)) and mine[m] == theirs[m]:
                m += 1
            return m

        donors = [(min(shared(d), d.prefilled // C), d) for d in self.active + self.prefilling
                  if d is not req and d.slot >= 0 and not d.finished]
        have, donor = max(donors, key=lambda x: x[0], default=(0, None))
        if have > done:
            self.engine.copy_positions(donor.slot, req.slot, done * C, have * C)
            self.shared_prefill_tokens += (have - done) * C
            req.prefilled, done = have * C, have
        return done < len(mine) and any(shared(d) > done and d.prefilled // C <= done for d in earlier
                                        if d.slot >= 0 and not d.finished)

    def _grow(self) -> None:
        """Paged caches: blocks for every running request's next step (positions up to its anchor + γ),
        oldest request first; while the pool is short, the newest request holding blocks is preempted:
        a running one's K/V are copied out and it resumes, first in line, with them (the same bits, so the
        same tokens), or, where the copy would pass the swap space, it prefills its prompt and emitted
        tokens again when it resumes (the same tokens where the prefill writes the bits its steps wrote: the
        CPU engines); a prefilling one starts its prefill again (the same chunks, so the same values)."""
        for req in sorted(self.active, key=lambda r: r.id):
            while req.slot >= 0 and not self.engine.kv.reserve(req.slot, req.position + self.gamma + 1):
                self._preempt(max(self.active + self.prefilling, key=lambda r: r.id))

    def _preempt(self, req: Request) -> None:
        if req in self.active:
            size = self.engine.block_bytes(req.position)
            if self.swapped_bytes + size <= self.swap_space:
                req.swapped = self.engine.swap_out(req.slot, req.position)
                self.swapped_bytes += size
                self.swapped_bytes_peak = max(self.swapped_bytes_peak, self.swapped_bytes)
            else:  # (past the swap space: its blocks go, and its K/V are computed again when it resumes)
                req.recompute = True
                req.prefilled = 0
                self.recomputations += 1
            self.active.remove(req)
        else:
            self.prefilling.remove(req)
        self._free_slot(req)
        req.preempted += 1
        self.preemptions += 1
        self.waiting.insert(0, req)

    def step(self) -> list[Request]:
        """One scheduler iteration: waiting requests take free slots, one speculative step runs over
        the requests past their prefill, then one prefill round (``_prefill_round``: the next chunk
        of each prefilling request, up to ``prefill_budget`` tokens; a request whose prompt is done
        has its first token at the end of the call, and steps from the next). So a long prompt or a
        burst of arrivals delays the running streams by at most one round per step, never by whole
        prompts, and a first token never waits for a step. → the requests that emitted tokens
        (``pending`` holds them).

        Chained steps (engines with ``chains``, the aoti engines): before it reads a step's rows,
        the generator launches the step after it for the same requests, its inputs advanced on the
        device (``engine.step_next``), so the device does not wait while the host reads the rows,
        emits tokens and prepares the next step. The next call reads that step's rows. A request that
        finished meanwhile has its row ignored (it only wrote its own cache slot, past its end); a
        batch that changes (a request finished or cancelled, one waiting to be admitted) is not
        chained again until it is stepped afresh. Outputs are those of unchained steps, token for
        token: the chained step computes exactly what the next call would have launched. (Under a
        confidence schedule, a chained step's width is planned from an earlier step's confidences,
        ``StaticStep._lagged``: greedy tokens are the same, sampled ones keep their distribution.)"""
        with self.lock:
            self._admit()
            if self.paged:
                self._grow()
            try:
                stepped = self._step()
            except BaseException:
                self._inflight = None  # (an engine failure: nothing chained survives it)
                raise
            # (a chained step in flight means no request is prefilling: _chains)
            prefilled = self._prefill_round() if self.prefilling and self._inflight is None else []
            return stepped + [r for r in prefilled if r not in stepped]

    def _step(self) -> list[Request]:
        eng, g = self.engine, self.gamma
        if self._inflight is not None:
            handle, batch = self._inflight
            self._inflight = None
        else:
            batch = list(self.active)
            if not batch:
                return []
            handle = None
        t0 = time.perf_counter()
        last = max(r.position for r in batch)

        def host_inputs():
            return ([r.anchor for r in batch], [r.position for r in batch], [r.slot for r in batch],
                    [r.params.seed for r in batch], [float(r.params.temperature) for r in batch])

        controlled = any(r.params.controls() for r in batch)
        if not eng.chains or (controlled and handle is None):
            # Host values in, lists out: two host→device copies and one back (the engines' step_host).
            if controlled:
                wanted = [r.params.logprobs for r in batch if r.params.logprobs is not None]
                packed = eng.step_host(*host_inputs(), last + g + 1, processing=[self._controls_row(r) for r in batch],
                                       logprobs_n=max(wanted) if wanted else None)
            else:
                packed = eng.step_host(*host_inputs(), last + g + 1)
            info = eng.take_step_info() if hasattr(eng, "take_step_info") else {}
            confidence, verified, logprobs = info.get("confidence"), info.get("verified"), info.get("logprobs")
        else:
            if handle is None:
                handle = eng.step_launch(*host_inputs(), last + g + 1)
            nxt = None
            confidence = verified = logprobs = None  # (the compiled steps return the drafts alone)
            if self._chains(batch):
                nxt = eng.step_next(handle, last + 2 * (g + 1))
            packed = eng.step_rows(handle)
            if handle.plan is not None:  # (a scheduled step: its confidences and width, on the host with its rows)
                confidence = handle.plan[0][: len(batch)].tolist()
                verified = [handle.plan[1]] * len(batch)
            if nxt is not None and not handle.redone:  # (after a retried step the chained one is invalid)
                self._inflight = (nxt, batch)
        self.step_times.append(time.perf_counter() - t0)
        done = []
        for i, (req, row) in enumerate(zip(batch, packed)):
            if req.finished or req.slot < 0:  # (finished, cancelled or preempted after this chained step was launched)
                continue
            draft, n, bonus = row[:g], row[g], row[g + 1]
            emitted = draft[:n] + [bonus]
            shown = self._emit(req, emitted)
            if logprobs is not None and req.params.logprobs is not None:
                req.logprobs.extend(self._top(lp, req.params.logprobs) for lp in logprobs[i][: len(shown)])
            req.add_step(StepRecord(req.position, draft, n, shown, confidence[i] if confidence else None,
                                    verified[i] if verified else None), g)
            req.anchor, req.position = bonus, req.position + n + 1
            done.append(req)
        return done

    @staticmethod
    def _top(lp: tuple, n: int) -> tuple[float, list[tuple[int, float]]]:
        """(the token's log-probability, the top ``n`` (token, logprob)) of one position."""
        return lp[0], lp[1][:n]

    def _chains(self, batch: list[Request]) -> bool:
        """Whether to launch the step after this one before reading its rows: the same requests are
        all still running, none is waiting for a free slot, the chained step's writes stay inside the
        caches (its largest position + γ is below max_seq), and some request surely needs it (more
        than γ+1 tokens left: this step emits at most γ+1). Paged caches: the chained step's positions
        (up to two steps past each request's anchor) get their blocks now, from the free pool without
        preempting anyone, or the step is not chained."""
        g = self.gamma
        if any(r.finished for r in batch) or self.prefilling or (self.waiting and self.free_slots):
            return False
        if max(r.position for r in batch) + 2 * (g + 1) > self.engine.max_seq:
            return False
        if not any(r.params.max_tokens - len(r.output) > g + 1 for r in batch):
            return False
        # (a reservation that fails takes nothing; those made before it serve the requests' next steps)
        return not self.paged or all(self.engine.kv.reserve(r.slot, r.position + 2 * (g + 1)) for r in batch)

    def run(self) -> None:
        while True:
            with self.lock:
                if not (self.waiting or self.prefilling or self.active):
                    return
                self.step()

    # ---- conveniences ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Request]:
        """Run ``prompts`` to the end, in-flight batched → their requests, in order. ``params``: one
        ``SamplingParams`` for all, or a list with one per prompt. Every prompt and its params are
        checked before any is queued: a ``RequestError`` (naming the prompt's index) queues none."""
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        if prompts and all(isinstance(p, int) for p in prompts):
            raise RequestError("prompts must be a list of prompts (lists of token ids), got a list of integers: "
                               "for one prompt, pass [prompt]")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one SamplingParams "
                                   "for all the prompts or a list with one per prompt")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                checked.append(self._check(p, sp))
            except RequestError as e:
                raise (RequestError(f"prompt {i} of {len(prompts)}: {e}") if len(prompts) > 1 else e) from None
        with self.lock:
            reqs = self._enqueue(checked)
        while True:
            with self.lock:  # per step: other threads' steps interleave (and advance these requests too)
                if all(r.finished for r in reqs):
                    return reqs
                self.step()

    def stream(self, prompt: list[int], params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield lists of token ids as steps accept them (the first from prefill)."""
        return self.iter_request(self.add(prompt, params))

    def iter_request(self, req: Request) -> Iterator[list[int]]:
        """Drive the scheduler until ``req`` finishes, yielding its tokens as they come;
        closing the iterator early cancels the request and frees its slot. The lock is taken
        for each step and released before each ``yield``."""
        try:
            while True:
                with self.lock:
                    chunk, req.pending = req.pending, []
                    done = req.finished
                    if not chunk and not done:
                        if not (self.waiting or self.prefilling or self.active):
                            raise RequestError(f"request {req.id} is not queued in this Generator")
                        self.step()
                        continue
                if chunk:
                    yield chunk
                if done:
                    return
        finally:
            if not req.finished:
                self.cancel(req)
