"""Tensor parallelism: the target split across ranks (Megatron style), one speculative step per rank set.

Each of ``world`` ranks holds a slice of every target layer:

* the stacked q/k/v/o_gate projection **by heads** (column-parallel): rank ``r`` has q heads
  ``[r·H/world, (r+1)·H/world)``, their output-gate rows, and the K/V heads they read — its share of
  the KV heads where there are at least ``world`` of them, else the one KV head its q heads share
  (replicated on the ranks of that group);
* ``o_proj`` by the same heads' columns and ``down_proj`` by its input columns (row-parallel): each
  rank's product is a partial sum, added over the ranks with one all-reduce per branch
  (``DecoderLayer.residual``, in FP32) before the branch norm and the gated FP32 residual;
* ``gate_proj``/``up_proj`` by the intermediate dimension (column-parallel).

An untied lm_head splits by vocabulary rows (``sharding.vocab_split``): each rank computes its slice of
the logits and one all-gather gives every rank the whole row, so acceptance and sampling, keyed by (seed,
position), give every rank the same tokens. The embedding and the final norm are replicated (a tied head
is the embedding, whole); the draft is replicated too: its five layers at batch 1 cost less
than the collectives sharding them would add. Rank 0 owns the scheduler: its ``LeaderEngine``
broadcasts each call that runs the model (a prefill round, a step, with their inputs) before running
it, and the other ranks (``follow``) run the same call on their slices, so any scheduler — the
Generator, the serving scheduler thread — drives a rank set unchanged.

``launch(world, fn, *args)`` starts the ranks as processes with ``torch.distributed`` (gloo on CPU,
NCCL on CUDA), a timeout on every collective so a rank that dies ends the group with an error instead
of a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from muse_spark.checkpoint import load_pair
from muse_spark.process import die_with_parent
from muse_spark.sharding import (TensorParallelError, check_engine_split, check_split, set_group,  # noqa: F401
                                 shard_config, shard_state_dict, shard_target, vocab_split)
from muse_spark.runtime.engine import EagerEngine
from muse_spark.runtime.groups import control_group, init_groups, model_group  # noqa: F401

COLLECTIVE_TIMEOUT_S = 60.0

def engine_from_checkpoints(target_dir, draft_dir, rank: int, world: int, *, device="cpu", dtype=None,
                            max_batch: int = 8, max_seq: int | None = None) -> EagerEngine:
    """This rank's eager engine over the pair: its target slice, the whole draft (bound to the
    replicated embedding)."""
    if str(device) == "cuda":
        device = f"cuda:{rank}"
    target, draft = load_pair(target_dir, draft_dir, dtype, device)
    part = shard_target(target, rank, world, model_group() if world > 1 else None)
    draft.bind_target_embeddings(part.model.embed_tokens.weight)
    del target
    tok = Path(target_dir) / "tokenizer.json"
    return EagerEngine(part, draft, max_batch=max_batch, max_seq=max_seq or min(part.cfg.max_position_embeddings, 2048),
                       device=device, tokenizer_path=tok if tok.is_file() else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple,
               results) -> None:
    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    init_groups()
    out = fn(rank, world, *args)
    if rank == 0:
        results.put(out)
    dist.barrier()  # every rank done before any leaves
    # Leave without tearing the group down: rank 0 hosts the group's store, and gloo's connection threads
    # abort the process (std::terminate) when the store goes away while another rank is still closing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, fn: Callable, *args, device: str = "cpu", timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (processes; gloo on CPU, NCCL on CUDA) → rank 0's
    result. A rank that fails ends the others (their collectives time out after ``timeout_s`` at the
    latest) and raises here with its error."""
    import torch.multiprocessing as mp

    if device.startswith("cuda") and torch.cuda.device_count() < world:
        raise TensorParallelError(f"--tp {world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_rank_main, args=(world, _free_port(), backend, timeout_s, fn, args, results),
                               nprocs=world, join=False, start_method="spawn")
    with _forward_signals(procs.processes[0].pid):
        while not procs.join(timeout=0.5):
            pass
    return results.get()


class _forward_signals:
    """While the ranks run: SIGTERM to this process goes on to rank 0 (a server drains, then ends the
    others), and SIGINT is left to the ranks (a terminal sends it to the whole group; rank 0 handles
    it). Only from the main thread (elsewhere signal handlers cannot be set)."""

    def __init__(self, leader_pid: int):
        self.pid, self.old = leader_pid, {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.old[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda *_: os.kill(self.pid, signal.SIGTERM))
            self.old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def generate_lead(leader, prompts, params) -> list[dict]:
    """Rank 0 of ``generate``: ``Generator.generate`` over the leader engine → outputs and stats."""
    from muse_spark.runtime.generator import Generator

    reqs = Generator(leader).generate(prompts, params)
    return [{"output": r.output, "stats": r.stats(leader.gamma), "steps": len(r.steps)} for r in reqs]


def generate_rank(rank: int, world: int, target_dir, draft_dir, prompts, params, device: str = "cpu",
                  max_batch: int = 8, max_seq: int | None = None, fail_rank: int | None = None):
    """One rank of ``generate``: rank 0 runs ``Generator.generate`` over its ``LeaderEngine``, the others
    follow → the requests' outputs and stats (rank 0's, returned by ``launch``). ``fail_rank``: that
    rank exits once its engine is loaded (tests: a rank that dies)."""
    import functools

    if rank == fail_rank:
        engine_from_checkpoints(target_dir, draft_dir, rank, world, device=device, max_batch=max_batch,
                                max_seq=max_seq)
        os._exit(3)
    return lead_or_follow(rank, world, target_dir, draft_dir, functools.partial(generate_lead, prompts=prompts,
                                                                                 params=params),
                          device=device, max_batch=max_batch, max_seq=max_seq)


def generate(target_dir, draft_dir, prompts, params, world: int, **kw) -> list[dict]:
    """``Generator.generate`` over a pair split across ``world`` ranks (processes) → per request its
    output and stats."""
    return launch(world, generate_rank, str(target_dir), str(draft_dir), prompts, params, kw.get("device", "cpu"),
                  kw.get("max_batch", 8), kw.get("max_seq"), kw.get("fail_rank"), device=kw.get("device", "cpu"),
                  timeout_s=kw.get("timeout_s", COLLECTIVE_TIMEOUT_S))


class LeaderEngine:
    """Rank 0's engine in a rank set driven by one scheduler: every call that runs the model
    (``prefill_chunks``, ``step_host``) is broadcast to the other ranks (``follow``) before it runs
    here, so they run the same call on their slices and the layers' collectives meet. Any scheduler
    over an engine (``Generator``, the serving scheduler thread) drives it unchanged; requests, their
    validation and their cancellation stay on rank 0. ``close()`` releases the followers.

    Each call holds a lock from its broadcast to the end of its local run, so that the keep-alive
    (``keepalive``: a server's idle rank set would otherwise reach the collectives' timeout while the
    followers wait for the next call) never lands between a call's collectives."""

    def __init__(self, engine: EagerEngine, group=None):
        import threading

        self._engine, self._group = engine, group
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._lock, self._last, self._closed = threading.RLock(), 0.0, threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _send(self, call: str, *args, **kw) -> None:
        import time

        dist.broadcast_object_list([(call, args, kw)], src=0, group=self._group)
        self._last = time.monotonic()

    def _run(self, call: str, *args, **kw):
        """Broadcast ``call`` and run it here, under the lock."""
        with self._lock:
            self._send(call, *args, **kw)
            return getattr(self._engine, call)(*args, **kw)

    def keepalive(self, interval_s: float = COLLECTIVE_TIMEOUT_S / 4) -> None:
        """While the set is idle, a no-op call every ``interval_s`` keeps the followers' wait within the
        collectives' timeout (servers call this; a one-shot ``generate`` does not need it)."""
        import threading
        import time

        def beat():
            while not self._closed.wait(interval_s / 2):
                with self._lock:
                    if not self._closed.is_set() and time.monotonic() - self._last >= interval_s:
                        self._send("ping")

        threading.Thread(target=beat, name="muse-spark-tp-keepalive", daemon=True).start()

    @property
    def chains(self) -> bool:
        """Whether the Generator chains steps (``AOTIEngine.step_launch``, not broadcast): only with no other rank
        (``--tp 1``: the engine's own chaining, so one rank's figures are the plain engine's); over ranks a chained
        step would run on rank 0 alone, its collectives never met, so the Generator waits for each step."""
        return self._world == 1 and self._engine.chains

    def prefill_chunks(self, chunks):
        return self._run("prefill_chunks", chunks)

    def set_controls(self, slot: int, row: dict) -> None:
        """A compiled engine's per-slot sampling controls (``AOTIEngine.set_controls``): every rank's
        controlled verification reads its own copy."""
        self._run("set_controls", slot, row)

    def step_host(self, *args, **kw):
        return self._run("step_host", *args, **kw)

    def step(self, *args, **kw):
        return self._run("step", *args, **kw)

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Every rank copies the same positions between the same slots of its own caches (its slice)."""
        self._run("copy_positions", src, dst, start, end)

    def store_block(self, key: bytes, slot: int, start: int, end: int) -> None:
        """A stored prompt block (``runtime/prefix_cache.py``): every rank keeps its slice of it."""
        self._run("store_block", key, slot, start, end)

    def load_block(self, key: bytes, slot: int, start: int, end: int) -> None:
        self._run("load_block", key, slot, start, end)

    def drop_block(self, key: bytes) -> None:
        self._run("drop_block", key)

    def time_collectives(self, rows: int, iters: int) -> float:
        """Median ms of one step's all-reduces alone (benchmarks), the other ranks running the same."""
        with self._lock:
            self._send("time_collectives", rows, iters)
            return time_collectives(self._engine, rows, iters)

    def set_schedule(self, schedule) -> None:
        """Every rank verifies the same drafts a step (their target rows must match)."""
        with self._lock:
            self._engine.set_schedule(schedule)  # (refused here first: then no rank changes)
            self._send("set_schedule", schedule)

    # chunk by chunk through the broadcast ``prefill_chunks``
    prefill = EagerEngine.prefill

    def close(self) -> None:
        with self._lock:
            if not self._closed.is_set():
                self._closed.set()
                self._send("close")


def time_collectives(engine: EagerEngine, rows: int, iters: int) -> float:
    """Median ms of a step's all-reduces alone: two a target layer over [rows, hidden] FP32, on the group the
    eager model's run on, the device synchronized around each repetition (every rank runs it together)."""
    from muse_spark.runtime.calibrate import median_ms

    buf = torch.zeros(rows, engine.tcfg.hidden_size, device=engine.device)

    def reduces():
        for _ in range(2 * engine.tcfg.num_hidden_layers):
            dist.all_reduce(buf, group=model_group())

    return median_ms(reduces, engine.device, iters)


def follow(engine: EagerEngine, group=None) -> int:
    """A follower rank: run each call rank 0's ``LeaderEngine`` broadcasts, until it closes → the
    number of calls run."""
    n = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        call, args, kw = box[0]
        if call == "close":
            return n
        if call == "time_collectives":
            time_collectives(engine, *args)
            continue
        if call == "ping":  # (the leader's keep-alive while its server is idle)
            continue
        getattr(engine, call)(*args, **kw)
        engine.take_step_info()  # (the extras are rank 0's to report)
        n += 1


def engine_from_dir(engine_dir, rank: int, world: int, *, device: str | None = None) -> EagerEngine:
    """This rank's engine from an engine directory (its weights, limits, tokenizer and options): its target
    slice and the whole draft. An eager engine on one device is split here; an engine built for ranks
    (``build --tp``: eager, or aoti with the packages every rank runs) loads this rank's weight file alone."""
    from muse_spark.engine_format import read_manifest

    if device is not None and str(device) == "cuda":
        device = f"cuda:{rank}"
    m = read_manifest(engine_dir)
    check_engine_split(m, world, engine_dir)
    if m.get("tensor_parallel"):  # (built for ranks: this rank's weight file alone)
        if m["backend"] == "aoti":
            from muse_spark.runtime.aoti_engine import AOTIEngine

            engine = AOTIEngine.from_dir(engine_dir, device=device, tp_rank=rank)
        else:
            engine = EagerEngine.from_dir(engine_dir, device=device, tp_rank=rank)
        # (the eager modules' own collectives: an eager engine's layers; a compiled one's first token of a prefill)
        head = engine.target.lm_head
        set_group(engine.target, model_group(), head is not None and head.out_features < engine.target.cfg.vocab_size)
        return engine
    if m["backend"] != "eager":  # (a compiled engine for one device, on one rank: check_engine_split)
        from muse_spark.runtime import load_engine

        return load_engine(engine_dir, device=device)
    full = EagerEngine.from_dir(engine_dir, device=device)
    part = shard_target(full.target, rank, world, model_group() if world > 1 else None)
    full.draft.bind_target_embeddings(part.model.embed_tokens.weight)
    return EagerEngine(part, full.draft, max_batch=full.max_batch, max_seq=full.max_seq, device=full.device,
                       tokenizer_path=full.tokenizer_path, manifest=full.manifest, options=full.options)


def lead_or_follow(rank: int, world: int, target_dir, draft_dir, lead: Callable, device: str = "cpu",
                   max_batch: int = 8, max_seq: int | None = None):
    """This rank's engine (from a checkpoint pair; ``draft_dir`` None: ``target_dir`` is an eager engine
    directory); rank 0 calls ``lead(LeaderEngine)`` (and returns its result), the others follow until
    it is done. Followers ignore SIGINT: a terminal's Ctrl-C reaches the whole group, and rank 0 ends
    them when it is done (or their collectives time out)."""
    import signal

    if draft_dir is None:
        engine = engine_from_dir(target_dir, rank, world, device=device)
    else:
        engine = engine_from_checkpoints(target_dir, draft_dir, rank, world, device=device, max_batch=max_batch,
                                         max_seq=max_seq)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(engine, control_group())
        return None
    leader = LeaderEngine(engine, control_group())
    try:
        return lead(leader)
    finally:
        leader.close()


# ---- a rank set joined from outside ``launch``: the Triton model (rank 0) and its followers ---------------


def _join(rank: int, world: int, port: int, device: str, timeout_s: float) -> None:
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    init_groups()


def join_as_leader(engine_dir, world: int, port: int, device: str = "cpu",
                   timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "LeaderEngine":
    """Rank 0 of a rank set whose followers were started apart (``follower_main``, by ``muse-spark serve``):
    it hosts the rendezvous on ``port``, loads its slice of the eager engine at ``engine_dir`` → its
    ``LeaderEngine`` (``close()`` releases the followers)."""
    _join(0, world, port, device, timeout_s)
    return LeaderEngine(engine_from_dir(engine_dir, 0, world, device=device), control_group())


def follower_main(argv: list[str] | None = None) -> int:
    """``python -m muse_spark.runtime.tensor_parallel --engine DIR --rank R --world N --port P [--device D]``:
    one follower rank of a rank set whose rank 0 joins on ``port`` (the Triton model: ``join_as_leader``).
    It loads its slice of the engine, runs what rank 0 broadcasts until it closes, and exits; it ends
    with the process that started it."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m muse_spark.runtime.tensor_parallel", description=follower_main.__doc__)
    p.add_argument("--engine", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for rank 0 and for each call")
    a = p.parse_args(argv)
    if not 1 <= a.rank < a.world:
        p.error(f"--rank must be in [1, {a.world}) (rank 0 leads)")
    die_with_parent()
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (rank 0 ends the set; a terminal's Ctrl-C reaches every rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.world))
    _join(a.rank, a.world, a.port, a.device, a.timeout)
    follow(engine_from_dir(a.engine, a.rank, a.world, device=a.device), control_group())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (without tearing the group down: see _rank_main)


if __name__ == "__main__":
    sys.exit(follower_main())
