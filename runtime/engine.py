"""The eager engine.

``load_engine`` checks an engine directory's manifest against the machine and
its own file hashes before anything is loaded (``muse_spark.engine_format``),
and refuses a mismatch with a clear error. The runtime reads engines only: it
never imports builder code.

The ``eager`` backend keeps the canonical (stacked) weights as safetensors and
runs the reference modules: it runs on any device and is also the ROCm
fallback. Compiled backends must reproduce it.

An engine runs with its kernel options (``muse_spark.options``): those its manifest records (its
run-scope choices from the environment or the caller), set around every eager call
(``use_options``), so any thread that calls it gets them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from muse_spark.config import parse_dtype
from muse_spark.engine_format import (EngineError, check_cache_memory, check_plugins, configs_from_manifest,
                                      kv_pool_blocks, kv_tokens_in_memory, read_manifest, verify_files)
from muse_spark.models.draft import MuseSparkDSparkForCausalLM
from muse_spark.models.layers import FP8, attention_path
from muse_spark.models.target import MuseSpark1xForCausalLM
from muse_spark.options import KernelOptions, engine_options, use_options
from muse_spark.plugins.acceptance.processing import Processing, logprobs, process_logits
from muse_spark.plugins.acceptance.reference import accept, sample_tokens
from muse_spark.checkpoint import load_pair, materialize
from muse_spark.runtime.kv_blocks import SWAP_SPACE_GIB, BlockPoolError, BlockTables, swap_space_bytes
from muse_spark.schedule import Schedule, plan
from muse_spark.sharding import fit_lm_head, shard_config

def neutral_controls(prompt: list[int]) -> dict:
    """Sampling controls that change nothing (a ``Processing.build`` row)."""
    return {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "min_tokens": 0, "prompt": list(prompt), "output": [], "stop_ids": []}


def _logprob_rows(lp: torch.Tensor, chosen: torch.Tensor, n: int) -> list[list[tuple]]:
    """lp [B, S, V] log-probabilities, chosen [B, S] tokens → per row, per position: (the chosen
    token's log-probability, [(token, logprob)] of the top ``n``), on the host."""
    ids = values = None
    if n > 0:
        values, ids = lp.topk(min(n, lp.shape[-1]), -1)
    return logprob_lists(lp.gather(-1, chosen[..., None]).squeeze(-1), ids, values)


def logprob_lists(picked: torch.Tensor, top_ids: torch.Tensor | None,
                  top_values: torch.Tensor | None) -> list[list[tuple]]:
    """picked [B, S] (the chosen tokens' log-probabilities), top_ids / top_values [B, S, N] (None: no
    alternatives) → per row, per position: (picked, [(token, logprob)] of the top N), on the host."""
    picked = picked.cpu().tolist()
    if top_ids is None:
        return [[(x, []) for x in row] for row in picked]
    ids, vals = top_ids.cpu().tolist(), top_values.cpu().tolist()
    return [[(x, list(zip(ids[b][s], vals[b][s]))) for s, x in enumerate(row)] for b, row in enumerate(picked)]


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a prompt to prefill: the tokens from ``start`` (a multiple of the engine's
    ``prefill_chunk``) up to the next chunk boundary, into cache slot ``slot``; ``seed`` and
    ``temperature`` sample the first token when the chunk ends the prompt."""

    prompt: list[int]
    start: int
    slot: int
    seed: int
    temperature: float
    processing: dict | None = None  # the request's sampling controls (a ``Processing.build`` row)
    logprobs_n: int | None = None


INPUT_NAMES = ("anchor", "anchor_pos", "slots", "seeds", "temperature")  # a step's per-request inputs


def host_step_inputs(anchor, anchor_pos, slots, seeds, temperature) -> tuple[np.ndarray, ...]:
    """A step's per-request host values (sequences of n values, or CPU tensors) as arrays, checked:
    n of each, integers for the four int64 inputs and numbers for the temperatures. A value the
    int64 rows would truncate or wrap (1.5, 2**70, "3") is refused, not rounded."""
    arrays = tuple(np.asarray(v) for v in (anchor, anchor_pos, slots, seeds, temperature))
    n = arrays[0].size
    for name, values in zip(INPUT_NAMES, arrays):
        if values.shape != (n,):
            raise ValueError(f"step input {name}: expected {n} values, got {values.size}")
        if values.dtype.kind not in ("iuf" if name == "temperature" else "iu") or (
                values.dtype.kind == "u" and values.size and int(values.max()) >= 2**63):
            raise ValueError(f"step input {name}: expected {'numbers' if name == 'temperature' else 'integers'}, "
                             f"got {values.dtype} values")
    return arrays


def with_options(method):
    """An engine method run under the engine's kernel options (``use_options(self.options)``). Its
    ``__wrapped__`` is the undecorated body, as ``torch.inference_mode`` leaves it, for callers that
    compile the body themselves and hold the options and inference mode around it."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        with use_options(self.options):
            return method(self, *args, **kw)

    run.__wrapped__ = inspect.unwrap(method)
    return run


def target_slice(manifest: dict, tcfg, tp_rank: int | None, where) -> tuple:
    """(the target config, the target weight file) of rank ``tp_rank`` of the engine ``manifest`` describes: the
    whole target of an engine on one device, that rank's share and file of one built for ranks (which needs a
    rank: ``runtime/tensor_parallel.py`` gives each its own)."""
    split = manifest.get("tensor_parallel") or {}
    if not split:
        return tcfg, "target.safetensors"
    if tp_rank is None:
        raise EngineError(f"{where}: this engine is split for {split.get('world')} tensor-parallel ranks: run it with "
                          f"--tp {split.get('world')}")
    if not 0 <= tp_rank < int(split.get("world", 0)):
        raise EngineError(f"{where}: rank {tp_rank} is outside the engine's {split.get('world')} ranks")
    return shard_config(tcfg, int(split["world"])), split["target_files"][tp_rank]


def build_modules(tcfg, dcfg, target_sd, draft_sd, dtype: torch.dtype, device) -> tuple[MuseSpark1xForCausalLM, MuseSparkDSparkForCausalLM]:
    """Reference modules from canonical state dicts (assigned, no second copy). Floating tensors take
    ``dtype``, but the residual gates, an FP8 projection's weight and scales and an FP8 KV cache's scales,
    which keep their own."""
    with torch.device("meta"):
        target = MuseSpark1xForCausalLM(tcfg, dcfg.target_layer_ids)
        draft = MuseSparkDSparkForCausalLM(dcfg)

    def own_dtype(name: str, t: torch.Tensor) -> bool:
        return (not t.is_floating_point()
                or name.endswith(("residual_gate", ".weight_scale", ".input_scale", ".k_scale", ".v_scale"))
                or t.dtype == FP8)

    fit_lm_head(target, target_sd)  # (a tensor-parallel rank's file: its vocabulary slice of the head)
    for module, sd in ((target, target_sd), (draft, draft_sd)):
        materialize(module, {k: (v if own_dtype(k, v) else v.to(dtype)) for k, v in sd.items()}, device, dtype)
    draft.bind_target_embeddings(target.model.embed_tokens.weight)
    return target, draft


class EagerEngine:
    """Runs prefill and speculative steps with the reference modules.

    Owns the KV caches (allocated once): target K/V per layer and the draft's
    context K/V per layer, ``[max_batch slots, max_seq, KV, Dh]`` each. ``options``: the kernel
    options its calls run under (default: the defaults).
    """

    backend = "eager"
    chains = False  # no chained steps (``AOTIEngine.step_launch``/``step_next``): the Generator waits each step

    def __init__(self, target: MuseSpark1xForCausalLM, draft: MuseSparkDSparkForCausalLM, *,
                 max_batch: int, max_seq: int, device, tokenizer_path: str | Path | None = None,
                 manifest: dict | None = None, prefill_chunk: int = 128, options: KernelOptions | None = None,
                 schedule: Schedule | None = None, kv_tokens: int | None = None, kv_block_size: int = 16,
                 swap_space: float = SWAP_SPACE_GIB):
        self.target, self.draft = target, draft
        self.options = options or KernelOptions()
        self.tcfg, self.dcfg = target.cfg, draft.cfg
        self.gamma = self.dcfg.block_size
        self.max_batch, self.max_seq = max_batch, max_seq
        self.device = torch.device(device)
        self.prefill_chunk = prefill_chunk
        self.manifest = manifest or {}
        self.tokenizer_path = tokenizer_path
        # Paged (``kv_tokens``): the caches are pools of ``kv_block_size``-token blocks that the slots take
        # as their requests grow (runtime/kv_blocks.py); else each slot owns max_seq positions.
        self.kv = None
        # host memory for the K/V of preempted requests (``Generator._preempt``; paged caches), in bytes
        self.swap_space_bytes = swap_space_bytes(swap_space)
        if kv_tokens is not None:
            self.kv = BlockTables.for_tokens(kv_tokens, kv_block_size, max_batch, max_seq, self.device)
            self.target_cache = target.allocate_paged_cache(self.kv.blocks, kv_block_size, max_seq, self.device)
            self.draft_cache = draft.allocate_paged_cache(self.kv.blocks, kv_block_size, max_seq, self.device)
        else:
            self.target_cache = target.allocate_cache(max_batch, max_seq, self.device)
            self.draft_cache = draft.allocate_cache(max_batch, max_seq, self.device)
        # The Triton attention's bits depend on where the visible keys sit: the draft's block keys
        # follow its context window, so on that path the window is the whole cache, as in the
        # compiled packages (plugins/attention, "Bits"); the Triton kernel skips the unseen tiles.
        self.full_draft_window = attention_path(self.device, target.dtype, self.options) == "triton"
        self.schedule = Schedule()
        self.set_schedule(schedule if schedule is not None else Schedule.from_dict(self.manifest.get("schedule")))
        self._confidence = self._verified = self._logprobs = None
        self._prefill_logprobs: dict[int, tuple] = {}

    def set_schedule(self, schedule: Schedule) -> None:
        """The verification policy of the following steps (``muse_spark.schedule``). Confidence
        scheduling needs the draft's confidence head, and an engine whose step verifies a chosen
        number of drafts: the eager engine's."""
        if schedule.needs_confidence and self.draft.model.confidence_head is None:
            raise EngineError("schedule 'confidence' needs a draft with a confidence head "
                              "(enable_confidence_head in its config.json); this draft has none")
        if schedule.on and not self.schedules:
            raise EngineError(f"schedule {schedule.mode!r} runs on the eager engine; the {self.backend} engine's "
                              "compiled step verifies every draft (schedule 'off')")
        self.schedule = schedule

    schedules = True  # (the compiled engines' steps verify all γ drafts)
    controls = True  # sampling controls and logprobs (plugins/acceptance/processing.py)

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_dir(cls, engine_dir: str | Path, device: str | None = None, dtype: str | None = None,
                 max_batch: int | None = None, options: KernelOptions | None = None, tp_rank: int | None = None,
                 **kw) -> "EagerEngine":
        """The engine at ``engine_dir``, run with the kernel options its manifest records
        (``options.engine_options``: the run-scope ones from ``options`` where given, else from the
        environment where it sets them). An engine built for tensor parallelism (``build --tp``)
        loads rank ``tp_rank``'s slice of the target (``runtime/tensor_parallel.py`` does)."""
        d = Path(engine_dir)
        m = read_manifest(d)
        if m["backend"] != cls.backend:
            raise EngineError(f"{d}: this is a {m['backend']!r} engine; {cls.__name__} loads {cls.backend!r} "
                              f"engines (muse_spark.runtime.load_engine loads any)")
        opts = engine_options(m, options, where=str(d))
        verify_files(d, m)
        check_plugins(m)
        tcfg, dcfg = configs_from_manifest(m)
        tcfg, target_file = target_slice(m, tcfg, tp_rank, d)
        dev = torch.device(device or m.get("device", {}).get("kind", "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"{d}: engine device is cuda but no CUDA device is available (use --device cpu)")
        dt = parse_dtype(dtype or m["dtype"])
        try:
            target_sd = load_file(str(d / target_file))
            draft_sd = load_file(str(d / "draft.safetensors"))
            target, draft = build_modules(tcfg, dcfg, target_sd, draft_sd, dt, dev)
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"{d}: engine weights cannot be loaded: {e}") from None
        max_batch = max_batch or m["max_batch"]
        if kw.get("kv_memory_fraction") is not None:  # (paged: the pool's size from the memory left after the weights)
            kw["kv_tokens"] = kv_tokens_in_memory(kw.pop("kv_memory_fraction"), tcfg, dcfg, dt, dev,
                                                  kw.get("kv_block_size", 16), m["max_seq"], where=f"{d}: ")
        kw.pop("kv_memory_fraction", None)
        if kw.get("kv_tokens") is not None:  # (paged: one pool of that many positions, not max_batch windows)
            P = kw.get("kv_block_size", 16)
            check_cache_memory(d, tcfg, dcfg, dt, max_batch=1, device=dev,
                               max_seq=kv_pool_blocks(kw["kv_tokens"], P, m["max_seq"], BlockPoolError) * P)
        else:
            check_cache_memory(d, tcfg, dcfg, dt, max_batch=max_batch, max_seq=m["max_seq"], device=dev)
        tok = d / m["tokenizer"] if m.get("tokenizer") else None
        return cls(target, draft, max_batch=max_batch, max_seq=m["max_seq"], device=dev,
                   tokenizer_path=tok, manifest=m, options=opts, **kw)

    @classmethod
    def from_checkpoints(cls, target_dir, draft_dir, device="cpu", dtype=None, max_batch=8,
                         max_seq=None, options: KernelOptions | None = None, kv_cache_dtype: str | None = None,
                         **kw) -> "EagerEngine":
        """An engine straight from a checkpoint pair (no engine directory); ``options``: its kernel
        options, by default the environment's (``KernelOptions.from_env``); ``kv_cache_dtype``: the target's
        KV cache ("auto" or "fp8"; None: as the checkpoint says)."""

        target, draft = load_pair(target_dir, draft_dir, dtype, device, kv_cache_dtype)
        tok = Path(target_dir) / "tokenizer.json"
        max_seq = max_seq or min(target.cfg.max_position_embeddings, 2048)
        return cls(target, draft, max_batch=max_batch, max_seq=max_seq, device=device,
                   tokenizer_path=tok if tok.is_file() else None,
                   options=KernelOptions.from_env() if options is None else options, **kw)

    # ---- prefill -----------------------------------------------------------------------
    def prefill(self, prompt: list[int], slot: int, seed: int, temperature: float) -> torch.Tensor:
        """Run the target over the prompt (chunked), store target KV and draft context K/V,
        and sample the first token (position len(prompt)). → [1] int64 on the device."""
        start, first = 0, None
        while first is None:
            (first,) = self.prefill_chunks([PrefillChunk(prompt, start, slot, seed, temperature)])
            start += self.prefill_chunk
        return first

    @with_options
    @torch.inference_mode()
    def prefill_chunks(self, chunks: list["PrefillChunk"]) -> list[torch.Tensor | None]:
        """The next chunk of each prompt (``prefill_chunk`` tokens from ``chunk.start``, a multiple of
        it) in one forward over the batch: target KV and draft context K/V written into each chunk's
        slot. A shorter (last) chunk is padded: its pad positions continue past its prompt (clamped
        into the window), where no query of the prompt looks and later steps overwrite them. → per
        chunk, the first generated token ([1] int64, position len(prompt)) where the chunk ends its
        prompt, else None."""
        dev, C = self.device, self.prefill_chunk
        n = [min(len(c.prompt), c.start + C) - c.start for c in chunks]
        width = max(n)
        tokens = torch.zeros(len(chunks), width, dtype=torch.int64)
        positions = torch.empty(len(chunks), width, dtype=torch.int64)
        for i, c in enumerate(chunks):
            tokens[i, : n[i]] = torch.tensor(c.prompt[c.start : c.start + n[i]])
            positions[i] = torch.arange(c.start, c.start + width).clamp_(max=self.max_seq - 1)
        slots = torch.tensor([c.slot for c in chunks], device=dev)
        positions = positions.to(dev)
        rows = self.cache_rows(slots)
        h, aux = self.target(tokens.to(dev), positions, rows, self.target_cache, int(positions.max()) + 1)
        self.draft.store_context(aux, positions, rows, self.draft_cache)
        done = [i for i, c in enumerate(chunks) if c.start + n[i] == len(c.prompt)]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        if done:
            rows = torch.tensor(done, device=dev)
            logits = self.target.logits(h[rows, torch.tensor([n[i] - 1 for i in done], device=dev)])  # [D, V]
            for i, first in zip(done, self._first_tokens(logits, [chunks[i] for i in done])):
                out[i] = first
        return out

    def _first_tokens(self, logits: torch.Tensor, chunks: list["PrefillChunk"]) -> list[torch.Tensor]:
        """The first generated token of each prompt whose last chunk is ``chunks[j]``, from the target's
        logits after its last token (``logits[j]``, [V]), under its sampling controls; its
        log-probabilities kept for ``take_prefill_logprobs`` where asked. → [1] int64 tensors."""
        dev = logits.device
        temps = torch.tensor([float(c.temperature) for c in chunks], device=dev, dtype=torch.float32)
        procs = [c.processing for c in chunks]
        if any(procs):  # (a request without controls gets the neutral ones)
            proc = Processing.build([p or neutral_controls(c.prompt) for p, c in zip(procs, chunks)],
                                    self.tcfg.vocab_size, dev)
            logits = process_logits(logits[:, None], logits.new_zeros(len(chunks), 0, dtype=torch.int64), proc,
                                    temps)[:, 0]
        first = sample_tokens(logits, temps, torch.tensor([c.seed for c in chunks], device=dev),
                              torch.tensor([len(c.prompt) for c in chunks], device=dev))
        wanted = [c.logprobs_n for c in chunks]
        if any(w is not None for w in wanted):
            lp = _logprob_rows(logprobs(logits[:, None], temps), first[:, None], max(w for w in wanted if w is not None))
            for j, c in enumerate(chunks):
                if wanted[j] is not None:
                    self._prefill_logprobs[c.slot] = lp[j][0]
        return [first[j : j + 1] for j in range(len(chunks))]

    def _all_caches(self) -> tuple[torch.Tensor, ...]:
        """Every cache tensor, ``[slots, max_seq, …]`` each (paged: ``[blocks, P, …]``): the target's K and
        V per layer, then the draft context's."""
        return (*self.target_cache.k, *self.target_cache.v, *self.draft_cache.k, *self.draft_cache.v)

    # ---- the caches by slot and position ----------------------------------------------------
    def cache_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """What the models address the caches by for requests in ``slots`` [B]: the slots themselves,
        or on paged caches their block tables [B, n]."""
        return slots if self.kv is None else self.kv.table[slots]

    def _at(self, slot: int, start: int, end: int):
        """Index of ``slot``'s positions ``[start, end)`` into every cache (``cache[index]``: [n, KV, Dh])."""
        return (slot, slice(start, end)) if self.kv is None else self.kv.positions(slot, start, end)

    def kv_description(self) -> str:
        """The caches' layout and size, for a server's startup line."""
        mib = sum(c.numel() * c.element_size() for c in self._all_caches()) / 2**20
        if self.kv is None:
            return f"KV: {self.max_batch} slots × {self.max_seq} positions ({mib:.1f} MiB)"
        return (f"KV: paged, a pool of {self.kv.capacity_tokens} positions in blocks of {self.kv.block_size} "
                f"({mib:.1f} MiB)")

    @torch.inference_mode()
    def swap_out(self, slot: int, end: int) -> tuple[torch.Tensor, ...]:
        """Copies of ``slot``'s positions ``[0, end)``, every cache, in host memory (a preempted request's
        state: ``swap_in`` puts it back, bit for bit)."""
        at = self._at(slot, 0, end)
        return tuple(c[at].to("cpu", copy=True) for c in self._all_caches())

    @torch.inference_mode()
    def swap_in(self, slot: int, saved: tuple[torch.Tensor, ...]) -> None:
        """Write ``swap_out``'s copies into ``slot``'s positions ``[0, n)`` (reserved before)."""
        at = self._at(slot, 0, saved[0].shape[0])
        for cache, values in zip(self._all_caches(), saved):
            cache[at] = values.to(cache.device)

    @torch.inference_mode()
    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` of cache slot ``src`` into slot ``dst``, every cache, in place
        (a request handed the prompt chunks another one prefilled; captured graphs keep their addresses)."""
        a, b = self._at(src, start, end), self._at(dst, start, end)
        for cache in self._all_caches():
            cache[b] = cache[a]

    # ---- stored prompt blocks (runtime/prefix_cache.py keeps their keys and order) -----------------
    def block_bytes(self, tokens: int) -> int:
        """The bytes one stored block of ``tokens`` positions holds (every cache's rows)."""
        return tokens * sum(c[0, 0].numel() * c.element_size() for c in self._all_caches())

    @torch.inference_mode()
    def store_block(self, key: bytes, slot: int, start: int, end: int) -> None:
        """Keep a copy of positions ``[start, end)`` of cache slot ``slot`` (every cache) under ``key``."""
        at = self._at(slot, start, end)
        self._blocks()[key] = tuple(c[at].clone() for c in self._all_caches())

    @torch.inference_mode()
    def load_block(self, key: bytes, slot: int, start: int, end: int) -> None:
        """Copy the block kept under ``key`` into positions ``[start, end)`` of slot ``slot``, in place."""
        at = self._at(slot, start, end)
        for cache, values in zip(self._all_caches(), self._blocks()[key]):
            cache[at] = values

    def drop_block(self, key: bytes) -> None:
        self._blocks().pop(key, None)

    def _blocks(self) -> dict:
        if not hasattr(self, "_stored_blocks"):
            self._stored_blocks = {}
        return self._stored_blocks

    def take_prefill_logprobs(self, slot: int):
        """The first token's (log-probability, top N) of the prompt prefilled into ``slot``, once."""
        return self._prefill_logprobs.pop(slot, None)

    # ---- speculative step ---------------------------------------------------------------
    @with_options
    @torch.inference_mode()
    def step(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, slots: torch.Tensor, seeds: torch.Tensor,
             temperature: torch.Tensor, kv_len: int, processing: Processing | None = None,
             logprobs_n: int | None = None) -> torch.Tensor:
        """One speculative step for a batch. All inputs [B] on the device; ``kv_len`` ≥ max(p)+γ+1.
        ``processing``: the requests' sampling controls (``plugins.acceptance.processing``), applied
        to the target's distribution at every position; ``logprobs_n``: keep the log-probabilities of
        the emitted tokens (and the top N at each position) for ``take_step_info``.

        → packed [B, γ+2] int64: the γ draft tokens (target ids), n accepted, the bonus token.
        """
        g = self.gamma
        ctx_len = self.max_seq if self.full_draft_window else kv_len - g - 1
        slots = self.cache_rows(slots)
        ids, probs, conf = self.draft.propose(anchor, anchor_pos, slots, self.draft_cache, ctx_len, seeds,
                                              temperature)
        verify, K = None, g
        if self.schedule.on:  # t_1 … t_k of each request go to the target, K = max k rows of them
            verify, K = plan(conf, self.schedule, anchor.shape[0], g, anchor.device)
        self._confidence, self._verified = conf, verify
        tokens = torch.cat([anchor[:, None], ids[:, :K]], 1)  # [B, K+1]
        positions = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)
        h, aux = self.target(tokens, positions, slots, self.target_cache, kv_len)
        logits = self.target.logits(h)
        if processing is not None:
            logits = process_logits(logits, ids[:, :K], processing, temperature)
        n, bonus = accept(logits, ids[:, :K], probs[:, :K], self.draft.d2t, temperature, seeds, anchor_pos, verify)
        if logprobs_n is not None:  # the emitted tokens t_1 … t_n, bonus at positions 0 … n
            at = torch.arange(K + 1, device=n.device)[None, :]
            chosen = torch.where(at < n[:, None], torch.cat([ids[:, :K], bonus[:, None]], 1), bonus[:, None])
            self._logprobs = _logprob_rows(logprobs(logits, temperature), chosen, logprobs_n)
        # Draft context for the newly verified tokens a, t_1 … t_n (positions p … p+n).
        # All K+1 are written (static shapes); those past p+n are overwritten next step
        # before any query can read them.
        self.draft.store_context(aux, positions, slots, self.draft_cache)
        return torch.cat([ids, n[:, None], bonus[:, None]], 1)

    def take_step_info(self) -> dict:
        """The last step's extras on the host, once: ``confidence`` (the head's values, [B][γ]),
        ``verified`` (drafts sent to the target per request, [B]; absent: all γ) and ``logprobs``
        (per request, per position 0 … K: (the emitted token's log-probability, [(token, logprob)] of
        the top N)), each where the step made it (a compiled step returns the drafts alone)."""
        info = {}
        if getattr(self, "_confidence", None) is not None:
            info["confidence"] = self._confidence.float().cpu().tolist()
        if getattr(self, "_verified", None) is not None:
            info["verified"] = self._verified.cpu().tolist()
        if getattr(self, "_logprobs", None) is not None:
            info["logprobs"] = self._logprobs
        self._confidence = self._verified = self._logprobs = None
        return info

    def step_host(self, anchor, anchor_pos, slots, seeds, temperature, kv_len: int, processing=None,
                  logprobs_n: int | None = None) -> list[list[int]]:
        """``step`` for host values (sequences of n ints; n floats for the temperatures) → the packed
        rows as lists of ints: the serving loop's form. Two host→device copies, one back.
        ``processing``: per-request sampling controls as ``Processing.build``'s rows (dicts)."""
        dev = self.device
        *ints, temps = host_step_inputs(anchor, anchor_pos, slots, seeds, temperature)
        ints = torch.from_numpy(np.stack(ints).astype(np.int64)).to(dev)
        temps = torch.from_numpy(temps.astype(np.float32)).to(dev)
        if not processing and logprobs_n is None:  # (the plain step: what the compiled engines' steps take)
            return self.step(*ints.unbind(0), temps, kv_len).cpu().tolist()
        proc = Processing.build(processing, self.tcfg.vocab_size, dev) if processing else None
        return self.step(*ints.unbind(0), temps, kv_len, proc, logprobs_n).cpu().tolist()

    # ---- target-only decoding (the reference the speculative output must equal) ---------
    @with_options
    @torch.inference_mode()
    def target_step(self, token: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, seeds: torch.Tensor,
                    temperature: torch.Tensor, kv_len: int) -> torch.Tensor:
        h, _ = self.target(token[:, None], pos[:, None], self.cache_rows(slots), self.target_cache, kv_len)
        return sample_tokens(self.target.logits(h[:, 0]), temperature, seeds, pos + 1)
