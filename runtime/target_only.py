"""Target-only decoding: the output speculative decoding must reproduce, and the baseline it is timed
against.

Greedy speculative output must equal this token for token; sampled output must
have the same distribution (and, keyed by the same seed, shares the bonus
noise stream ``SALT_TARGET`` position by position).

``generate_target_only`` decodes one prompt eagerly (the exactness reference); ``TargetOnlyDecoder``
decodes a batch, on CUDA from one captured graph per batch size (the baseline of
``benchmarks/generation.py``), with the same tokens.
"""

from __future__ import annotations

import time

import torch

from muse_spark.runtime.engine import PrefillChunk
from muse_spark.runtime.generator import Generator, Request, RequestError, SamplingParams
from muse_spark.runtime.cuda_graph import GraphMemory, capture


def generate_target_only(engine, prompt: list[int], params: SamplingParams, slot: int = 0) -> list[int]:
    gen = Generator(engine)
    req = gen.add(prompt, params)  # same validation and stop handling as the speculative path
    gen.waiting.remove(req)
    p, dev = req.params, engine.device
    seeds = torch.tensor([p.seed], device=dev, dtype=torch.int64)
    temps = torch.tensor([float(p.temperature)], device=dev, dtype=torch.float32)
    slots = torch.tensor([slot], device=dev)
    tok = engine.prefill(req.prompt, slot, p.seed, float(p.temperature))
    pos = len(req.prompt)
    gen._emit(req, [int(tok.item())])
    while not req.finished:
        tok = engine.target_step(tok, torch.tensor([pos], device=dev), slots, seeds, temps, pos + 1)
        pos += 1
        gen._emit(req, [int(tok.item())])
    return req.output


class _GraphStep:
    """``engine.target_step`` for a batch of ``n`` captured in a CUDA graph over static inputs, attending
    over the whole window (``kv_len = max_seq``: keys past a row's position are masked, and every
    attention path's bits follow the visible keys only, so one graph serves every position). The
    capture's warm-up runs the step for real: its rows point at ``free_slot`` (position 0), a slot no
    running request holds, which its next prefill rewrites."""

    @torch.inference_mode()
    def __init__(self, engine, n: int, free_slot: int, memory: GraphMemory):

        dev = engine.device
        self.inputs = [torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(4)]
        self.inputs.append(torch.zeros(n, dtype=torch.float32, device=dev))
        self.token, self.pos, self.slots = self.inputs[:3]
        self.slots.fill_(free_slot)
        self.graph, self.out = capture(lambda: engine.target_step(*self.inputs, engine.max_seq), memory)

    @torch.inference_mode()
    def __call__(self, host_inputs: list[list] | None) -> list[int]:
        """One step → its tokens. ``host_inputs``: the five per-request inputs as host values; None:
        the rows of the last replay, advanced on the device (token ← its output, position + 1)."""
        if host_inputs is None:
            self.token.copy_(self.out)
            self.pos.add_(1)
        else:
            for dst, values in zip(self.inputs, host_inputs):
                dst.copy_(torch.tensor(values, dtype=dst.dtype))
        self.graph.replay()
        return self.out.tolist()


class TargetOnlyDecoder:
    """Several prompts decoded at once by the target alone, one token per request per step: the
    baseline speculative decoding is measured against. Each request's tokens equal
    ``generate_target_only``'s (greedy; sampled with the same seed): a row's step reads only its own
    cache slot, and sampling is keyed by (seed, position).

    A private ``Generator`` validates the requests and emits their tokens (the same checks and the
    same stop / ``max_tokens`` handling as speculative generation). Prompts are prefilled into slots
    0 … n−1, a chunk of each a round (``engine.prefill_chunks``; more than ``engine.max_batch`` prompts run in
    successive batches), then each step runs
    ``engine.target_step`` over the requests still running; a finished request leaves the batch.
    The decoder writes the engine's cache slots: no ``Generator`` may use the engine meanwhile.

    On CUDA (``cuda_graphs``) each batch size's step is captured once in a CUDA graph
    (``_GraphStep``) and replayed: while the batch is unchanged its inputs advance on the device, so
    a step costs the replay and one device→host copy of its tokens. Elsewhere the step runs eagerly
    over the keys up to the batch's last position. ``step_times``: seconds of each step (tokens on
    the host included)."""

    def __init__(self, engine, cuda_graphs: bool = True):
        self.engine = engine
        self.gen = Generator(engine)  # (validation and stop handling only: it never steps)
        self.cuda_graphs = cuda_graphs and engine.device.type == "cuda"
        self.graphs: dict[int, _GraphStep] = {}
        self._memory = GraphMemory(engine.device) if self.cuda_graphs else None
        self.step_times: list[float] = []

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Request]:
        """Decode ``prompts`` to the end → their requests, in order (``Generator.generate``'s
        arguments; every prompt is checked before any runs)."""
        if not isinstance(prompts, (list, tuple)) or any(not isinstance(p, (list, tuple)) for p in prompts):
            raise RequestError("prompts must be a list of prompts (lists of token ids)")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} SamplingParams for {len(prompts)} prompts: give one SamplingParams "
                               "for all the prompts or a list with one per prompt")
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                checked.append(self.gen._check(p, sp))
            except RequestError as e:
                raise (RequestError(f"prompt {i} of {len(prompts)}: {e}") if len(prompts) > 1 else e) from None
        reqs = self.gen._enqueue(checked)
        self.gen.waiting.clear()
        for start in range(0, len(reqs), self.engine.max_batch):
            self._decode(reqs[start:start + self.engine.max_batch])
        return reqs

    def _decode(self, reqs: list[Request]) -> None:
        """``reqs`` (at most max_batch), request i in slot i, to the end."""
        eng, gen = self.engine, self.gen
        if self.cuda_graphs:
            self._graph(len(reqs), free_slot=0)  # (captured before any of these slots holds a prompt)
        for req in reqs:
            req.t_start = time.perf_counter()
        # The prompts' chunks in rounds, the next chunk of every prompt not yet done a round (one engine call:
        # as the speculative Generator prefills a round), each first token emitted as its prompt ends.
        tokens: list[int | None] = [None] * len(reqs)
        start = 0
        while todo := [i for i, t in enumerate(tokens) if t is None]:
            chunks = [PrefillChunk(reqs[i].prompt, start, i, reqs[i].params.seed, float(reqs[i].params.temperature))
                      for i in todo]
            for i, first in zip(todo, eng.prefill_chunks(chunks)):
                if first is not None:
                    tokens[i] = int(first.item())
                    gen._emit(reqs[i], tokens[i : i + 1])
            start += eng.prefill_chunk
        pos = [len(req.prompt) for req in reqs]
        last = None  # the rows of the last step
        while rows := [i for i, r in enumerate(reqs) if not r.finished]:
            t0 = time.perf_counter()
            host = [[tokens[i] for i in rows], [pos[i] for i in rows], rows,
                    [reqs[i].params.seed for i in rows], [float(reqs[i].params.temperature) for i in rows]]
            if self.cuda_graphs:
                free = min(set(range(len(reqs))) - set(rows), default=0)  # (a new size: some request finished)
                out = self._graph(len(rows), free)(None if rows == last else host)
            else:
                out = self._eager(host)
            self.step_times.append(time.perf_counter() - t0)
            for i, t in zip(rows, out):
                tokens[i], pos[i] = t, pos[i] + 1
                gen._emit(reqs[i], [t])
            last = rows

    def _graph(self, n: int, free_slot: int) -> _GraphStep:
        if n not in self.graphs:
            self.graphs[n] = _GraphStep(self.engine, n, free_slot, self._memory)
        return self.graphs[n]

    def _eager(self, host: list[list]) -> list[int]:
        dev = self.engine.device
        ints = torch.tensor(host[:4], dtype=torch.int64).to(dev)
        temps = torch.tensor(host[4], dtype=torch.float32).to(dev)
        return self.engine.target_step(*ints.unbind(0), temps, max(host[1]) + 1).tolist()


class TargetOnlyEngine:
    """An engine seen by a ``Generator`` (and so by the serving scheduler) as decoding with the target
    alone: each step emits one token per request, the target's, as ``generate_target_only`` does — the
    baseline a serving user would run without speculation, under the same arrivals and batching.

    Everything but the step is the wrapped engine's (its prefill, caches, limits). ``step_host`` runs
    ``engine.target_step`` over the batch and answers in the speculative step's row layout with no
    draft accepted (γ zeros, n = 0, the token as the bonus). On CUDA, an engine with a scratch cache
    slot (the compiled ones) replays one captured graph per batch size (``_GraphStep``, captured
    with every row on the scratch slot); otherwise the step runs eagerly over the keys up to the
    batch's last position."""

    chains = False  # (the Generator waits for each step)
    controls = False  # (sampling controls: the speculative engines')
    stateful_controls = False
    schedules = False

    def __init__(self, engine):
        self.engine = engine
        self.graphs: dict[int, _GraphStep] = {}
        scratch = getattr(engine, "scratch_slot", None)
        self.cuda_graphs = engine.device.type == "cuda" and scratch is not None
        self._memory = GraphMemory(engine.device) if self.cuda_graphs else None

    def __getattr__(self, name):  # (what the Generator reads of the engine: its own)
        return getattr(self.engine, name)

    @property
    def backend(self) -> str:
        return f"{self.engine.backend} (target only)"

    def take_step_info(self) -> dict:
        return {}

    @torch.inference_mode()
    def step_host(self, anchor, anchor_pos, slots, seeds, temperature, kv_len: int) -> list[list[int]]:
        """One target-only step → rows ``[0 × γ, 0, token]`` (the token at anchor_pos + 1)."""
        host = [list(anchor), list(anchor_pos), list(slots), list(seeds), [float(t) for t in temperature]]
        if self.cuda_graphs:
            n = len(host[0])
            if n not in self.graphs:
                self.graphs[n] = _GraphStep(self.engine, n, self.engine.scratch_slot, self._memory)
            tokens = self.graphs[n](host)
        else:
            dev = self.engine.device
            ints = torch.tensor(host[:4], dtype=torch.int64).to(dev)
            temps = torch.tensor(host[4], dtype=torch.float32).to(dev)
            tokens = self.engine.target_step(*ints.unbind(0), temps, kv_len).tolist()
        zeros = [0] * (self.engine.gamma + 1)
        return [zeros + [t] for t in tokens]
