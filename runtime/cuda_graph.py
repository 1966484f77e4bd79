"""Static-shape step runners: one per batch bucket, replayed from a CUDA graph on CUDA.

A compiled step graph has static shapes ``[B]`` for its per-request inputs.
``StaticStep`` owns those inputs as static buffers: a batch of ``n ≤ B``
requests is copied into rows ``[0, n)`` and rows ``[n, B)`` are *padding*,
pointed at the scratch cache slot (``max_batch``) with position 0, so they
compute harmlessly and write only the scratch slot. Per-request seeds and
temperatures are ordinary inputs: nothing request-specific is baked into a
graph.

``CUDAGraphStep`` captures the AOTI package (loaded with
``run_single_threaded=True``; the default loader's run synchronizes an event and
cannot be captured) once and replays it. Footgun: a captured graph replays raw
device pointers, so replay is only right while every tensor it was captured
with is still the one in use. The runner records those pointers and checks them
on every replay; it never falls back silently to an uncaptured run. The check
runs just *after* the replay is launched, while the GPU works (a scan of ~80
pointers took 9–12 µs of host time, which before the launch was the step's
latency): the runner keeps every captured tensor's storage alive, so a replay
only ever touches memory it owns, and a replay whose check fails raises before
its result is returned (that step's rows are never seen).

No step synchronizes with the host: the inputs are copied device-to-device into
the static buffers and the caller does the one device→host copy of the packed
result. ``step_host`` is the serving path's shortcut: the per-request inputs come
as host values (Python ints and floats), are written into a pinned host twin of
the static buffers (which are rows of one packed buffer) and copied in with one
asynchronous copy (no pageable staging, no device-to-device pass); the packed
result comes back in one device→host copy into a pinned buffer.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable, Collection, Sequence

import torch

from muse_spark.engine_format import EngineError
from muse_spark.runtime.engine import INPUT_NAMES, host_step_inputs

log = logging.getLogger(__name__)

Tensor = torch.Tensor


class MarkovKernelError(EngineError):
    """The fused Markov kernel's programs gave up waiting for each other (its error flag)."""


class StepHandle:
    """A step launched by ``StaticStep.launch_host``/``launch_next``: its rows are read with
    ``StaticStep.rows``."""

    __slots__ = ("runner", "serial", "n", "out", "host", "done", "inputs", "parent", "redone", "_rows", "plan")

    def __init__(self, runner, serial, n, out, host, done, inputs, parent, plan=None):
        self.runner, self.serial, self.n, self.out, self.host, self.done = runner, serial, n, out, host, done
        self.inputs, self.parent, self.redone, self._rows = inputs, parent, False, None
        # a scheduled step's (confidences [n, γ] float32 on the host, complete once its rows are, the width K)
        self.plan = plan

    def host_inputs(self) -> tuple[list, ...]:
        """The step's inputs as host values: given (``launch_host``) or advanced from the step before's
        rows (``launch_next``), as the device advanced them."""
        if self.inputs is None:
            p = self.parent
            anchor, pos, slots, seeds, temps = p.host_inputs()
            rows = p.runner.rows(p) if p._rows is None else p._rows
            g = len(rows[0]) - 2
            self.inputs = ([r[g + 1] for r in rows], [q + r[g] + 1 for q, r in zip(pos, rows)], slots, seeds, temps)
        return self.inputs


class StaticStep:
    """Runs a static-batch step graph for any batch of up to ``bucket`` requests."""

    def __init__(self, fn: Callable, bucket: int, weights: Sequence[Tensor], caches: Sequence[Sequence[Tensor]],
                 scratch_slot: int, device: torch.device, markov_words: int = 0, ctl: tuple | None = None):
        self.fn = fn
        self.ctl = ctl
        self.bucket = bucket
        self.weights = list(weights)
        self.caches = tuple(list(c) for c in caches)  # tk, tv, dk, dv
        # The caches as the caller holds them (its lists, not copies): a CUDA graph's replay checks that
        # they still hold the captured tensors, so the engine need not scan them before each step.
        self.live_caches = caches
        # The fused Markov kernel's words (``markov_words`` int64, from the manifest; 0: the step
        # runs the reference loop), zeroed once here and kept: every call leaves them ready for
        # the next, so no step zeroes them (plugins/markov/triton_kernel.py).
        self.markov_ws = torch.zeros(markov_words, dtype=torch.int64, device=device)
        self.scratch_slot = scratch_slot
        self.device = device
        # The five per-request inputs are rows of one int64 buffer (the temperatures' row read as
        # float32), each row starting 16-byte aligned: ``step_host`` fills them with one copy.
        width = bucket + bucket % 2
        self.packed = torch.zeros(len(INPUT_NAMES), width, device=device, dtype=torch.int64)
        self.static_inputs = self._rows(self.packed, bucket)
        self.anchor, self.anchor_pos, self.slots, self.seeds, self.temperature = self.static_inputs
        self.padding = (0, 0, scratch_slot, 0, 0.0)  # padding rows: scratch slot, position 0, greedy
        self.slots.fill_(scratch_slot)
        self._real_rows = 0  # rows [_real_rows, bucket) hold padding
        self._views: dict[int, list[Tensor]] = {}  # the inputs' first n rows, by n
        pin = device.type == "cuda"  # a pinned host twin: an asynchronous copy (CUDA only)
        self.host_packed = torch.zeros(self.packed.shape, dtype=torch.int64, pin_memory=pin)
        self.host_arrays = tuple(t.numpy() for t in self._rows(self.host_packed, bucket))  # cheap writes
        self.host_out: Tensor | None = None  # pinned [bucket, γ+2], made on the first step_host
        self.copied_in = torch.cuda.Event() if pin else None  # the last host→device copy read the twin
        self.copied_out = torch.cuda.Event() if pin else None
        self._serial = 0  # steps launched through ``launch_host``/``launch_next``
        self._out_ring: list[Tensor] = []  # two pinned row buffers, one per step in flight
        # chained scheduled steps (``_lagged``): the width planned from the newest earlier step's confidences on
        # the host (0: none yet, the full width), and the launched steps' confidences on their way to the host
        # (event or None, host tensor), oldest first
        self._lag_width = 0
        self._lag_pending: list[tuple] = []

    @staticmethod
    def _rows(packed: Tensor, bucket: int) -> tuple[Tensor, ...]:
        """The per-request inputs as views of ``packed`` [5, width] int64: four int64 rows and the
        temperatures, float32 [bucket] over the last row's bytes."""
        return (*(packed[i, :bucket] for i in range(len(INPUT_NAMES) - 1)),
                packed[-1].view(torch.float32)[:bucket])

    def _fill(self, anchor: Tensor, anchor_pos: Tensor, slots: Tensor, seeds: Tensor, temperature: Tensor) -> int:
        n = anchor.shape[0]
        if not 1 <= n <= self.bucket:
            raise ValueError(f"batch of {n} requests does not fit the bucket of {self.bucket}")
        srcs = (anchor, anchor_pos, slots, seeds, temperature)
        for name, src in zip(INPUT_NAMES, srcs):
            if src.shape != (n,):
                raise ValueError(f"step input {name}: expected shape [{n}], got {list(src.shape)}")
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = [t[:n] for t in self.static_inputs]
        # Device→device or host→device, no sync: the host work before the replay is on the step's
        # latency. The four int64 rows in one call (one multi-tensor launch on CUDA where the
        # caller's dtypes match; a list of mixed dtypes falls back to one copy per tensor: five
        # copies a step in the H200 profile), the temperatures (float32) apart.
        torch._foreach_copy_(views[:-1], srcs[:-1])
        views[-1].copy_(srcs[-1])
        self._pad(n)
        return n

    def _pad(self, n: int) -> None:
        """Rows [n, bucket) must be padding: refill the ones an earlier, larger batch wrote."""
        if n < self._real_rows:
            for dst, fill in zip(self.static_inputs, self.padding):
                dst[n:].fill_(fill)
        self._real_rows = n

    def _fill_host(self, anchor, anchor_pos, slots, seeds, temperature) -> int:
        """Host values (sequences of ints / floats, or CPU tensors) → the static buffers, padding rows
        as ``_fill`` makes them: written into the pinned host twin of the packed inputs, then one
        asynchronous host→device copy of all five (no pageable staging, no device-to-device pass)."""
        n = self._write_twin(anchor, anchor_pos, slots, seeds, temperature)
        self.packed.copy_(self.host_packed, non_blocking=True)  # all five inputs, one copy
        if self.copied_in is not None:
            self.copied_in.record(torch.cuda.current_stream(self.device))
        return n

    def _write_twin(self, anchor, anchor_pos, slots, seeds, temperature) -> int:
        """Host values → the pinned host twin of the packed inputs, padding rows included (once the
        last copy from the twin has read it); the caller copies it in. → n."""
        n = len(anchor)
        if not 1 <= n <= self.bucket:
            raise ValueError(f"batch of {n} requests does not fit the bucket of {self.bucket}")
        inputs = host_step_inputs(anchor, anchor_pos, slots, seeds, temperature)
        if self.copied_in is not None:
            self.copied_in.synchronize()  # the previous step's copy has read the pinned twin
        for values, arr, fill in zip(inputs, self.host_arrays, self.padding):
            arr[:n] = values
            arr[n:] = fill
        self._real_rows = n  # (the padding rows are written too)
        return n

    def _to_host(self, out: Tensor, n: int) -> list[list[int]]:
        if self.host_out is None or self.host_out.shape != out.shape:
            self.host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=self.copied_out is not None)
        self.host_out.copy_(out, non_blocking=True)
        if self.copied_out is not None:
            self.copied_out.record(torch.cuda.current_stream(self.device))
            self.copied_out.synchronize()
        return self.host_out.numpy()[:n].tolist()

    def _run(self) -> Tensor:
        return self.fn(self.weights, *self.caches, self.markov_ws, *self.static_inputs)

    _execute = _run  # the step as this runner runs it (CUDAGraphStep: the graph's replay)

    # ---- scheduled steps: the draft, a choice on the host, the verification of K drafts -------------
    # ``planner``: None, the whole step at once (``_execute``); else a function of the drafts'
    # confidences on the host ([n, γ] float32, the batch's real rows) → the verification width K, a
    # width the step holds (``LayeredStep.widths``): the step runs as its two halves with that choice
    # between them (``_scheduled``). ``last_plan``: (confidences, K) of the last scheduled step.
    planner: Callable[..., int] | None = None
    last_plan: tuple[Tensor, int] | None = None
    first_width = 0  # a chained scheduled step's width before any plan (``restart_plans``)
    # ``ctl``: the sampling controls' per-slot state (``SpecPair.step_verify_ctl``'s last five inputs),
    # where the step holds the controlled verification; ``controlled``: the next steps run it (the full
    # width; its other outputs, the log-probabilities, in ``last_ctl``).
    ctl: tuple[Tensor, ...] | None = None
    controlled = False
    last_ctl: tuple[Tensor, ...] | None = None

    def _step(self) -> Tensor:
        """The step over the static inputs → its packed [bucket, γ+2] output."""
        if self.controlled:
            packed, *self.last_ctl = self._execute_ctl()
            return packed
        return self._execute() if self.planner is None else self._scheduled()

    def _run_ctl(self) -> tuple[Tensor, ...]:
        return self.fn(self.weights, *self.caches, self.markov_ws, *self.static_inputs, ctl=self.ctl)

    _execute_ctl = _run_ctl

    def _draft_half(self) -> tuple:
        tk, tv, dk, dv = self.caches
        return self.fn.draft(self.weights, dk, dv, self.markov_ws, *self.static_inputs)

    def _verify_half(self, drafted: tuple, K: int) -> Tensor:
        return self.fn.verify(self.weights, *self.caches, self.markov_ws, self.slots, self.seeds, self.temperature,
                              drafted, K)

    def _scheduled(self) -> Tensor:
        """The draft half, its confidences to the host (the one wait inside the step), the planner's
        width, the verification half at that width."""
        drafted = self._draft_half()
        conf = drafted[5][: self._real_rows].to("cpu", torch.float32)
        K = self.planner(conf)
        self.last_plan = (conf, K)
        return self._verify_half(drafted, K)

    def restart_plans(self, first_width: int) -> None:
        """A new schedule: chained scheduled steps run ``first_width`` until one is planned from their confidences
        (the earlier schedule's plans and confidences dropped)."""
        self.first_width, self._lag_width, self._lag_pending = first_width, 0, []

    def _lagged(self) -> Tensor:
        """A chained scheduled step (``launch_host``/``launch_next``): its width is the plan of the newest earlier
        step of this runner whose confidences are already on the host (``first_width`` before any), so the host
        never waits inside the step and the next one can be launched before this one's rows are read. Its own
        confidences go to the host behind it (``last_plan``, then the handle's ``plan``). Any width chosen from
        the drafts' side keeps the output exact (``accept``'s ``verify``); a stale one only verifies more or
        fewer drafts than a fresh plan would."""
        ready = None
        while self._lag_pending and (self._lag_pending[0][0] is None or self._lag_pending[0][0].query()):
            ready = self._lag_pending.pop(0)[1]
        if ready is not None:
            self._lag_width = self.planner(ready, record=False)
        K = self._lag_width or self.first_width
        drafted = self._draft_half()
        out = self._verify_half(drafted, K)
        conf = drafted[5][: self._real_rows]
        host = torch.empty(conf.shape, dtype=torch.float32, pin_memory=self.copied_out is not None)
        host.copy_(conf, non_blocking=True)
        event = None
        if self.copied_out is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._lag_pending.append((event, host))
        self.last_plan = (host, K)
        return out

    def __call__(self, anchor, anchor_pos, slots, seeds, temperature) -> Tensor:
        """→ packed [n, γ+2] int64 on the device (a fresh tensor, not a view of a static buffer).
        n = −1 in every row: the fused Markov kernel failed (see ``step_host``); run it again after
        ``reset_markov()``."""
        n = self._fill(anchor, anchor_pos, slots, seeds, temperature)
        return self._step()[:n].clone()

    def step_host(self, anchor, anchor_pos, slots, seeds, temperature) -> list[list[int]]:
        """``__call__`` for host values (sequences of n ints, n floats for the temperatures) → the
        packed rows as lists of ints, after one device→host copy (the step is finished on return).

        Where the fused Markov kernel raised its error flag (a program gave up waiting for the
        others: not all were resident at once, e.g. another process held SMs), the step's rows
        say so (n = −1) and its drafts are not valid: the step runs once more on a zeroed
        workspace. That is exact: the inputs, seeds and cache rows it reads are unchanged, and it
        writes the same cache positions again. A second failure raises ``MarkovKernelError``."""
        n = self._fill_host(anchor, anchor_pos, slots, seeds, temperature)
        return self._retried(self._to_host(self._step(), n), n)

    def _flagged(self, rows: list[list[int]]) -> bool:
        """Whether a step's rows say the fused Markov kernel failed (n = −1; only with a workspace)."""
        return bool(self.markov_ws.numel()) and any(r[-2] < 0 for r in rows)

    def _retried(self, rows: list[list[int]], n: int) -> list[list[int]]:
        """``rows`` of the step in the static inputs, or where they are flagged, the rows of that step run
        once more on a zeroed workspace; a second failure raises ``MarkovKernelError``."""
        if self._flagged(rows):
            self.reset_markov()
            rows = self._to_host(self._step(), n)
            if self._flagged(rows):
                self.reset_markov()
                raise MarkovKernelError(
                    f"the fused Markov kernel failed twice in a row at batch bucket {self.bucket}: its programs "
                    "were not all resident on the GPU at once (is another process using this GPU's SMs?)")
        return rows

    # ---- chained steps: the next step launched before this one's rows are read ------------------
    def launch_host(self, anchor, anchor_pos, slots, seeds, temperature) -> "StepHandle":
        """``step_host`` without the wait: fill the static inputs from host values, run the step, start
        the one device→host copy of its rows into a pinned buffer of its own. → a handle for
        ``rows`` (and ``launch_next``)."""
        inputs = tuple(list(v) for v in (anchor, anchor_pos, slots, seeds, temperature))
        n = self._fill_host(*inputs)
        return self._launch(n, inputs, None)

    def launch_next(self, prev: "StepHandle") -> "StepHandle":
        """The step after ``prev`` (the last step this runner launched), launched before ``prev``'s rows
        are read: its inputs advanced on the device from ``prev``'s output, as the host would advance
        them (anchor ← bonus, anchor_pos ← anchor_pos + n + 1; slots, seeds, temperatures and the
        padding rows unchanged). The host never waits between the two, so the device does not idle
        while the host reads a step's rows and prepares the next."""
        if prev.runner is not self or prev.serial != self._serial:
            raise ValueError("launch_next: the step before must be the last one this runner launched")
        g = prev.out.shape[1] - 2
        n = prev.n
        with torch.inference_mode():
            self.anchor[:n].copy_(prev.out[:n, g + 1])
            self.anchor_pos[:n].add_(prev.out[:n, g] + 1)
        return self._launch(n, None, prev)

    def _launch(self, n: int, inputs, parent) -> "StepHandle":
        lagged = self.planner is not None and not self.controlled
        out = self._lagged() if lagged else self._step()
        self._serial += 1
        if not self._out_ring:  # (a runner's output has one shape: [bucket, γ+2])
            pin = self.copied_out is not None
            self._out_ring = [torch.empty(out.shape, dtype=out.dtype, pin_memory=pin) for _ in range(2)]
        host = self._out_ring[self._serial % 2]
        host.copy_(out, non_blocking=True)
        done = None
        if self.copied_out is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return StepHandle(self, self._serial, n, out, host, done, inputs, parent, self.last_plan if lagged else None)

    def rows(self, h: "StepHandle") -> list[list[int]]:
        """Wait for step ``h`` and return its packed rows (``step_host``'s). At most two steps are in
        flight: a handle whose pinned buffer a later step reused is refused. Where the fused Markov
        kernel raised its error flag, the step runs again from its host inputs on a zeroed workspace
        (``step_host``'s protocol, ``_retried``; exact) and ``h.redone`` is set: a step launched after ``h`` was
        computed from its invalid rows and must be dropped (the caller does)."""
        if h.runner is not self or h.serial < self._serial - 1:
            raise ValueError("rows: this step's buffer was reused by later steps (more than two in flight)")
        if h.done is not None:
            h.done.synchronize()
        rows = h.host.numpy()[: h.n].tolist()
        if self._flagged(rows):  # the static inputs may have moved on (launch_next): h's go back in first
            h.redone = True
            self._fill_host(*h.host_inputs())
            rows = self._retried(rows, h.n)
            if h.plan is not None:  # (run again by ``_step``: its own plan, fresh)
                h.plan = self.last_plan
        h._rows = rows
        return rows

    def reset_markov(self) -> None:
        """Zero the kept Markov workspace (its error flag too): a zeroed one serves any next call."""
        with torch.inference_mode():  # (an engine makes its runners under inference mode)
            self.markov_ws.zero_()


# The outgoing port of a rewritten edge (``make_programmatic``): "programmatic", the dependent launches
# as the kernel before triggers or its programs exit (the kernels trigger nothing, so: as they exit);
# "launch_order", as soon as all of its programs have started.
PDL_PORTS = ("programmatic", "launch_order")


def make_programmatic(graph: int, waiting: Collection[str], port: str = "programmatic") -> tuple[int, int]:
    """Turn each edge kernel → kernel of the captured CUDA graph ``graph`` (a ``cudaGraph_t``, e.g.
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()``, before it is instantiated) whose
    downstream kernel's name is in ``waiting`` into a programmatic edge (PDL, docs/pdl.md):
    that kernel may launch before the one before it has finished, which its ``griddepcontrol.wait``
    makes safe. A kernel that does not wait before it touches memory must never be in ``waiting``.
    Edges from or to other nodes (copies, memsets) stay. → (edges rewritten, kernel nodes)."""
    if port not in PDL_PORTS:
        raise ValueError(f"PDL port {port!r}: expected one of {PDL_PORTS}")
    from cuda.bindings import driver as cu  # (torch's CUDA 13 wheels depend on cuda-bindings)

    def check(result, what: str):
        err, *rest = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise EngineError(f"making the step graph's edges programmatic: {what} failed: {err!r}")
        return rest

    h = cu.CUgraph(graph)
    n = check(cu.cuGraphGetEdges(h, 0), "cuGraphGetEdges")[3]
    frm, to, data, _ = check(cu.cuGraphGetEdges(h, n), "cuGraphGetEdges")
    names: dict[int, str | None] = {}

    def kernel_name(node) -> str | None:
        """The node's kernel's name; "" for a kernel whose name is unknown; None: not a kernel."""
        key = int(node)
        if key not in names:
            kind = check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType")[0]
            name = None
            if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                params = check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")[0]
                name = ""
                if int(params.func):
                    err, raw = cu.cuFuncGetName(params.func)
                    if err == cu.CUresult.CUDA_SUCCESS and raw:
                        name = raw.decode() if isinstance(raw, bytes) else str(raw)
            names[key] = name
        return names[key]

    waiting = frozenset(waiting)
    # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC; CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC / _LAUNCH_ORDER
    pdl_type, out_port = 1, {"programmatic": 1, "launch_order": 2}[port]
    rewritten = 0
    for a, b, e in zip(frm, to, data):
        if int(e.type) != 0 or kernel_name(a) is None or kernel_name(b) not in waiting:
            continue
        pe = cu.CUgraphEdgeData()
        pe.type = pdl_type
        pe.from_port = out_port
        check(cu.cuGraphRemoveDependencies(h, [a], [b], [e], 1), "cuGraphRemoveDependencies")
        check(cu.cuGraphAddDependencies(h, [a], [b], [pe], 1), "cuGraphAddDependencies")
        rewritten += 1
    return rewritten, sum(1 for v in names.values() if v is not None)


class GraphMemory:
    """The memory of one owner's CUDA graphs (an engine's steps, a target-only runner's): a private pool
    and a capture stream of its own, created with the CUDA runtime rather than taken from torch's
    round-robin stream pool.

    Why a stream of its own: PyTorch keys the cuBLAS workspace by (handle, stream), and a graph captures
    the workspace's raw pointer; destroying a graph drops every workspace of its capture stream
    (``CUDAGraph.reset`` → ``clearCublasWorkspacesForStream``). With one capture stream for all graphs
    (``torch.cuda.graph``'s default) a second engine's graphs replay a workspace in the first one's pool,
    and unloading either (a model reload, a test's engine collected) frees memory the other still
    replays. Per owner, the graphs that share a workspace die together. The stream lives as long as the
    process (a stream destroyed earlier could hand its address to a new one while the old graphs still
    clear by it): one stream per engine loaded."""

    def __init__(self, device: torch.device | str | int = "cuda"):
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = _owned_stream(self.device)


def _owned_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking CUDA stream of its own on ``device``, never destroyed (``GraphMemory``); torch's
    pooled stream, with a warning, where the CUDA runtime's bindings (cuda-bindings) cannot make one."""
    try:
        from cuda.bindings import runtime as cudart  # (torch's CUDA 13 wheels depend on cuda-bindings)

        with torch.cuda.device(device):
            err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaStreamCreateWithFlags: {err}")
        return torch.cuda.ExternalStream(int(handle), device=device)
    except Exception as e:  # (ImportError included: the graphs still capture, on a pooled stream)
        log.warning("no CUDA stream of its own for an engine's graphs (%s): they capture on a pooled stream, "
                    "which graphs another engine captured may share", e)
        return torch.cuda.Stream(device)


def capture(fn: Callable, memory: GraphMemory, graph: torch.cuda.CUDAGraph | None = None, warmup: int = 1):
    """``fn`` captured in a CUDA graph → (the graph, what the captured call returned). First ``warmup``
    calls on a side stream (kernel modules load on a first run, and capture must not be the first
    run), joined into the current stream and synchronized; then the capture into ``graph`` (default:
    a new one) from ``memory``'s pool on its stream, on its device. The graph is not replayed."""
    graph = torch.cuda.CUDAGraph() if graph is None else graph
    device = memory.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    # (no automatic garbage collection while capturing: an unreachable engine collected mid-capture would
    # destroy its graphs and free their memory, which a global-mode capture must not see)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=memory.pool, stream=memory.stream):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class CUDAGraphStep(StaticStep):
    """A ``StaticStep`` captured once in a CUDA graph and replayed every step.

    ``programmatic``: the names of the kernels in the step that wait before any memory access (an
    engine built with the kernel option ``pdl``: its manifest's ``aoti.pdl_kernels``); the edges into
    them become programmatic (``make_programmatic``, through ``pdl_port``) before the graph is
    instantiated. ``programmatic_edges``: how many did."""

    def __init__(self, *args, memory: GraphMemory | None = None, warmup: int = 2, programmatic: Collection[str] = (),
                 pdl_port: str = "programmatic", split: bool = False, **kw):
        super().__init__(*args, **kw)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        memory = GraphMemory(self.device) if memory is None else memory  # (the step's graphs: one pool and stream)

        def capture_step(fn: Callable, warmup: int) -> tuple[torch.cuda.CUDAGraph, Tensor, int, int]:
            """``fn`` captured, its edges into ``programmatic`` kernels made programmatic → (graph, output,
            edges rewritten, kernel nodes)."""
            graph, out = capture(fn, memory, torch.cuda.CUDAGraph(keep_graph=bool(programmatic)), warmup)
            edges = kernels = 0
            if programmatic:
                edges, kernels = make_programmatic(graph.raw_cuda_graph(), programmatic, pdl_port)
                graph.instantiate()
            return graph, out, edges, kernels

        # Warmed up before the capture: all rows are padding, so only the scratch slot is written.
        self.graph, self.out, self.programmatic_edges, self.graph_kernels = capture_step(self._run, warmup)
        # ``split`` (a step with narrower verification widths): the halves of a scheduled step too, the
        # draft half once and the verification half at each width, over the draft half's outputs.
        self.halves: dict = {}
        if self.ctl is not None:  # the controlled step: all rows padding, only the scratch slot's state changes
            self.halves["ctl"] = capture_step(lambda: StaticStep._run_ctl(self), warmup)[:2]
        if split:
            self.halves["draft"] = capture_step(lambda: StaticStep._draft_half(self), warmup)[:2]
            drafted = self.halves["draft"][1]
            for K in sorted(self.fn.widths):
                self.halves[K] = capture_step(lambda K=K: StaticStep._verify_half(self, drafted, K), warmup)[:2]
        torch.cuda.synchronize(self.device)
        # What a replay reads and writes, as captured: their pointers, checked on every replay, and their
        # storages, kept: a tensor given other memory in place (``set_``) or replaced in the caller's cache
        # lists cannot free the memory the graph replays into, so a replay launched before its pointer
        # check touches nothing but what this runner owns.
        captured = self._tensors(weights=True)
        self._captured = tuple(map(Tensor.data_ptr, captured))
        self._unweighted = len(captured) - len(self.weights)  # the pointers checked on every replay
        self._storages = [t.untyped_storage() for t in captured]
        self._weights_checked = False  # the weights' pointers: checked until a replay has passed with them
        self.replays = 0

    def _tensors(self, weights: bool) -> list[Tensor]:
        """What a replay must find where it was captured: the static inputs, the workspace, the caller's
        caches as its lists hold them now (an entry may have been replaced), and with ``weights`` the
        weights."""
        return [*self.static_inputs, self.markov_ws, *(t for c in self.live_caches for t in c), *(self.ctl or ()),
                *(self.weights if weights else ())]

    def check(self, caches: Sequence[Sequence[Tensor]]) -> None:
        """Assert that ``caches`` (the engine's) are the ones this graph was captured with."""
        if len(caches) != len(self.caches) or any(
                len(mine) != len(theirs) or any(a.data_ptr() != b.data_ptr() for a, b in zip(mine, theirs))
                for mine, theirs in zip(self.caches, caches)):
            raise AssertionError("CUDA graph replay with KV caches other than those it was captured with")

    def _assert_unmoved(self, full: bool) -> None:
        """Assert that every captured tensor is still where it was and that the caller's caches still
        hold them; ``full``: the weights too (~500 tensors for an 8B pair)."""
        if tuple(map(Tensor.data_ptr, self._tensors(full))) != self._captured[: None if full else self._unweighted]:
            self.check(self.live_caches)  # a cache replaced in the caller's lists
            raise AssertionError("CUDA graph replay after a captured input tensor was reallocated")

    def _draft_half(self) -> tuple:
        graph, drafted = self.halves["draft"]
        self._replay(graph)
        return drafted

    def _execute_ctl(self) -> tuple[Tensor, ...]:
        graph, out = self.halves["ctl"]
        self._replay(graph)
        return out

    def _verify_half(self, drafted: tuple, K: int) -> Tensor:
        graph, out = self.halves[K]
        return self._replay(graph, out)

    def _replay(self, graph: "torch.cuda.CUDAGraph | None" = None, out: Tensor | None = None) -> Tensor:
        """Replay ``graph`` (default: the whole step's) → ``out`` (default: the step's output)."""
        # Launched first, checked while the GPU runs it (the module's docstring): the host's scan of
        # the pointers is off the step's latency, and a failed check raises before the caller sees
        # this replay's result.
        (graph or self.graph).replay()
        self.replays += 1
        try:
            self._assert_unmoved(full=not self._weights_checked)
        except AssertionError as e:
            raise AssertionError(f"{e}; the replay ran on the captured tensors (their memory kept by the runner) "
                                 "and its result is discarded") from None
        self._weights_checked = True
        return self.out if out is None else out

    _execute = _replay
