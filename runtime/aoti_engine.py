"""The ``aoti`` engine: AOTInductor packages driven over the reference modules' weights.

``AOTIEngine.from_dir`` checks the manifest against this machine (backend,
device kind, compute capability, torch version), the files against their
hashes, then loads the canonical weights once and the packages (a prompt
chunk: ``prefill_layer``, ``prefill_finish``, and where the engine was built with a prefill batch P the
same for up to P chunks at once, ``_p{P}``; a step per batch bucket:
``step_draft_b{B}``, ``step_layer_b{B}``, ``step_verify_b{B}``, ``step_context_b{B}``), which take
those weights and the KV caches as inputs (``muse_spark/graphs/parts.py`` says
why); the one layer package runs every target layer. On CUDA each bucket's
step (all its package calls; the draft context on a second stream beside the
last layers and the verification, the kernel option ``context_stream``) is captured in
one CUDA graph (``runtime/cuda_graph.py``); on CPU the packages are called directly with
the same static buffers.

It is an ``EagerEngine`` for everything it does not compile: it exposes the
same attributes to the ``Generator``, and ``target_step`` (target-only
decoding, the reference) runs the eager modules over the same weights and
caches. Its output must equal the eager engine's: greedy token for token,
sampled token for token given the same seeds (all randomness is keyed by
(seed, position), and the graphs compute the reference functions).

Loading in a fresh process (docs/aoti.md): see ``load_package``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from muse_spark.config import dtype_name, parse_dtype
from muse_spark.graphs.parts import (CTL_FLOATS, CTL_INTS, LAYOUT, LayeredPrefill, embed_and_norm, LayeredStep, SpecPair, weight_names, weight_specs,
                                            weight_tensors)
from muse_spark.runtime.cuda_graph import CUDAGraphStep, GraphMemory, StaticStep, StepHandle
from muse_spark.engine_format import (EngineError, check_cache_memory, check_plugins, configs_from_manifest,
                                      manifest_kv_pool, read_manifest, verify_files)
from muse_spark.options import KernelOptions, current_options, engine_options
from muse_spark.plugins.acceptance.processing import Processing
from muse_spark.schedule import Schedule, plan
from muse_spark.runtime.engine import EagerEngine, PrefillChunk, build_modules, logprob_lists, target_slice, with_options
from muse_spark.runtime.kv_blocks import SWAP_SPACE_GIB, BlockTables, swap_space_bytes

log = logging.getLogger(__name__)


# ---- compatibility ----------------------------------------------------------------------------
def machine_info(device: torch.device) -> dict:
    """What an engine is checked against: device kind, name, compute capability, torch version."""
    info = {"kind": device.type, "name": "cpu", "compute_capability": None, "torch": torch.__version__}
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        info.update(name=torch.cuda.get_device_name(device), compute_capability=[cc[0], cc[1]])
    return info


def check_compatibility(manifest: dict, here: dict, where: str = "engine", section: str = "aoti") -> None:
    """Refuse, with the reason, an aoti (or ``section``: tensorrt) engine this machine cannot run
    (``here`` = ``machine_info``)."""
    if section not in manifest:
        raise EngineError(f"{where}: manifest lacks its {section!r} section; rebuild the engine")
    built_dev = manifest.get("device", {})
    if built_dev.get("kind") != here["kind"]:
        raise EngineError(
            f"{where}: engine was compiled for {built_dev.get('kind')!r} and cannot run on {here['kind']!r} "
            f"(AOTInductor packages are device-specific); rebuild it with --device {here['kind']}"
        )
    built_torch = manifest.get("versions", {}).get("torch")
    if built_torch != here["torch"]:
        raise EngineError(
            f"{where}: engine was compiled with torch {built_torch}, this runtime has torch {here['torch']}: "
            f"AOTInductor packages are tied to the torch that compiled them; rebuild the engine"
        )
    if here["kind"] == "cuda":
        cc = built_dev.get("compute_capability")
        if cc is None or list(cc) != list(here["compute_capability"]):
            built = "?" if cc is None else f"{cc[0]}.{cc[1]}"
            mine = "{}.{}".format(*here["compute_capability"])
            raise EngineError(
                f"{where}: engine was compiled for compute capability {built} ({built_dev.get('name')}), "
                f"this device ({here['name']}) is {mine}: its kernels cannot run here; rebuild the engine on it"
            )


# ---- loading packages -------------------------------------------------------------------------
def programmatic_kernels(aoti: dict) -> tuple[str, ...]:
    """The kernels whose incoming edges the step graphs make programmatic: the manifest's
    ``pdl_kernels`` (an engine built with the kernel option ``pdl``), or none, with a warning, where
    cuda-bindings (the CUDA driver's Python API, which edits the graphs) is missing: the step is
    then the same, only launched without PDL."""
    names = tuple(aoti.get("pdl_kernels") or ())
    if names:
        try:
            import cuda.bindings.driver  # noqa: F401
        except ImportError as e:
            log.warning("this engine was built for PDL step graphs, but cuda-bindings does not import (%s): "
                        "its steps run without PDL (pip install cuda-bindings for them)", e)
            return ()
    return names


class _ScalarCPUPackageNotice(logging.Filter):
    """CPU engines compiled with ``fast_compile`` are scalar code on purpose; the loader's
    "Device information mismatch for AOTI_CPU_ISA: … vs INVALID_VEC_ISA" warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "INVALID_VEC_ISA" not in record.getMessage()


logging.getLogger("torch.export.pt2_archive._package").addFilter(_ScalarCPUPackageNotice())


def libstdcxx_global() -> bool:
    """Put the libstdc++ torch already loaded into the global symbol scope; True if it is there.

    A package's model library is ``dlopen``-ed by libtorch with ``RTLD_LOCAL``;
    its references to C++ runtime symbols are looked up in the global scope
    first, then in its own dependency tree, which starts with the library
    itself. ``import torch`` loads libtorch, and with it libstdc++, with
    ``RTLD_LOCAL``, so libstdc++ is not in the global scope of a Python
    process (a C++ program links it, so it is). The CUDA model libraries built
    on the H200 device machine (torch 2.11.0+cu130) do not link libstdc++ and
    carry their own copies of some of its locale code (``codecvt<char16_t, char>``);
    bound to those copies instead of libstdc++'s, the ``std::regex`` in the
    model's constructor picked the wrong locale facet and crashed (a cuda-gdb
    backtrace and the loader's symbol bindings are in docs/aoti.md). With
    libstdc++ global, the library binds to it, as in a C++ program.
    ``RTLD_NOLOAD`` only promotes the copy already loaded; it never loads one.
    """
    global _LIBSTDCXX
    if _LIBSTDCXX is None:
        try:
            _LIBSTDCXX = ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        except (OSError, AttributeError):  # not loaded (not a libstdc++ build) or not Linux
            return False
    return True


_LIBSTDCXX = None


def load_package(path: str | Path, device: torch.device, single_threaded: bool = False):
    """Load one AOTI package for ``device`` (the runtime's only way to load one).

    On CUDA, torch's CUDA state is initialized and the device made current on
    this thread before the package's library is loaded, and the device index is
    passed explicitly. Before any package is loaded, libstdc++ is put in the
    process's global symbol scope (``libstdcxx_global``; docs/aoti.md says why).
    """
    libstdcxx_global()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError("engine device is cuda but no CUDA device is available")
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)
        torch.empty(1, device=f"cuda:{index}")  # the primary context exists and is current here
        torch.cuda.synchronize(index)
        device_index = index
    else:
        device_index = -1
    from torch._inductor import aoti_load_package  # (a bare `import torch._inductor` here would rebind `torch`)

    try:
        return aoti_load_package(str(path), run_single_threaded=single_threaded, device_index=device_index)
    except RuntimeError as e:
        raise EngineError(f"AOTI package {path} cannot be loaded: {e}") from None


def _part(d: Path, graphs: dict | None, name: str, device, single_threaded: bool = False):
    file = graphs[name]["file"] if graphs is not None else f"{name}.pt2"
    return load_package(d / file, device, single_threaded=single_threaded)


def load_step(d: str | Path, graphs: dict | None, bucket: int, target, draft, device,
              single_threaded: bool = False, side_stream: bool | None = None, loader=None,
              widths: list[int] = (), controls: bool = False) -> LayeredStep:
    """Bucket ``bucket``'s speculative step from its four packages in ``d`` (``graphs``: the
    manifest's file names; None: the builder's default names), and for each narrower verification
    width K in ``widths`` its layer, verify and context packages (``_k{K}``). ``side_stream``: run the draft
    context on a second CUDA stream beside the last target layers and the verification
    (``LayeredStep``); None: as the current kernel options' ``context_stream`` says; CUDA only.
    ``loader``: part name → the callable part (default: its AOTI package in ``d``). ``controls``: the
    bucket's verification under the sampling controls too (``step_verify_ctl_b{B}``)."""
    d, names = Path(d), weight_names(SpecPair(target, draft))
    loader = loader or (lambda name: _part(d, graphs, name, device, single_threaded))
    parts = [loader(f"step_{p}_b{bucket}") for p in ("draft", "layer", "verify", "context")]
    ctl_fn = loader(f"step_verify_ctl_b{bucket}") if controls else None
    narrower = {K: tuple(loader(f"step_{p}_b{bucket}_k{K}") for p in ("layer", "verify", "context"))
                for K in widths if K < draft.cfg.block_size}
    device = torch.device(device)
    if side_stream is None:
        side_stream = current_options().context_stream
    side = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
    return LayeredStep(names, target.cfg.num_hidden_layers, target.aux_layer_ids, *parts, draft.cfg.block_size,
                       side=side, widths=narrower, ctl_fn=ctl_fn)


def load_prefill(d: str | Path, graphs: dict | None, target, draft, device, loader=None,
                 batch: int = 1) -> LayeredPrefill:
    """The prefill of ``batch`` chunks at once (1: ``prefill_layer``/``prefill_finish``, else their ``_p{batch}``
    packages)."""
    d, names = Path(d), weight_names(SpecPair(target, draft))
    loader = loader or (lambda name: _part(d, graphs, name, device))
    suffix = "" if batch == 1 else f"_p{batch}"
    return LayeredPrefill(names, target.cfg.num_hidden_layers, target.aux_layer_ids, embed_and_norm(target),
                          loader(f"prefill_layer{suffix}"), loader(f"prefill_finish{suffix}"))


def markov_words(aoti: dict, bucket: int, where) -> int:
    """The int64 words of bucket ``bucket``'s kept Markov workspace (the manifest's
    ``markov_workspace_words``), checked: a count the package was not compiled for is refused."""
    n = aoti.get("markov_workspace_words", {}).get(str(bucket))
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise EngineError(f"{where}: the manifest's markov_workspace_words has no valid entry for batch bucket "
                          f"{bucket} (got {n!r}); rebuild the engine")
    return n


def prefill_groups(n: int, width: int) -> list[tuple[int, int]]:
    """How ``n`` prefill chunks split into calls of a prefill taking ``width`` chunks at once: [start, end) of each
    call, in order. Full calls of ``width`` first; what is left goes into one padded call when it fills more than
    half of its rows, else one chunk a call. (A call's cost grows with its rows once they pass the GEMMs' compute
    bound, padding rows too: a call of ``width`` chunks of which most are padding can cost more than the few
    chunks it holds run one at a time.)"""
    if n < 0 or width < 1:
        raise ValueError(f"{n} chunks in calls of {width}: want n ≥ 0 and width ≥ 1")
    full = n - n % width
    groups = [(i, i + width) for i in range(0, full, width)]
    left = n - full
    if 2 * left > width:  # (a lone chunk left over never is: with width 1 nothing is left over)
        groups.append((full, n))
    else:
        groups += [(i, i + 1) for i in range(full, n)]
    return groups


def prefill_batch(aoti: dict, where) -> int:
    """The chunks one prefill call takes at most (the manifest's ``prefill_batch``; 1 where it has none), checked:
    a positive integer whose packages the manifest lists, else the engine is refused."""
    p = aoti.get("prefill_batch", 1)
    graphs = aoti.get("graphs") or {}
    if (not isinstance(p, int) or isinstance(p, bool) or p < 1
            or (p > 1 and not {f"prefill_layer_p{p}", f"prefill_finish_p{p}"} <= set(graphs))):
        raise EngineError(f"{where}: the manifest's prefill_batch {p!r} names no prefill packages it lists; "
                          "rebuild the engine")
    return p


# ---- the engine -------------------------------------------------------------------------------
class AOTIEngine(EagerEngine):
    backend = "aoti"
    # the sampling controls' state lives on the device, per slot: the Generator hands the engine a
    # request's controls once, when its prefill ends (``set_controls``)
    stateful_controls = True
    section = "aoti"  # the manifest's section that describes the parts

    def __init__(self, target, draft, *, engine_dir: str | Path, manifest: dict, device, max_batch: int,
                 tokenizer_path=None, cuda_graphs: bool = True, options: KernelOptions | None = None,
                 swap_space: float = SWAP_SPACE_GIB):
        # Not EagerEngine.__init__: the caches have one scratch slot more (padding rows write it).
        a = manifest[self.section]
        self.options = options or KernelOptions.from_manifest(manifest, str(engine_dir))
        self.target, self.draft = target, draft
        self.tcfg, self.dcfg = target.cfg, draft.cfg
        self.gamma = self.dcfg.block_size
        self.schedule = Schedule()
        # the verification widths its step packages were compiled for (drafts verified per request)
        self.verify_widths = sorted(a.get("verify_widths") or [self.gamma])
        self._confidence = self._verified = self._logprobs = None
        self._prefill_logprobs = {}
        self.max_batch, self.max_seq = max_batch, manifest["max_seq"]
        self.device = torch.device(device)
        self.manifest = manifest
        self.tokenizer_path = tokenizer_path
        self.prefill_chunk = a["prefill_chunk"]
        self.scratch_slot = a["scratch_slot"]
        # paged (built with a pool: ``kv_pool`` [blocks, P]): the graphs address pools of blocks through the
        # slots' block tables (the scratch slot's row names block 0: padding rows write there)
        self.kv = None
        self.swap_space_bytes = swap_space_bytes(swap_space)  # (``EagerEngine``'s)
        pool = manifest_kv_pool(a.get("kv_pool"), self.max_seq, engine_dir, self.section)
        if pool:
            blocks, P = pool
            self.kv = BlockTables(blocks, P, a["cache_slots"], self.max_seq, self.device)
            self.target_cache = target.allocate_paged_cache(blocks, P, self.max_seq, self.device)
            self.draft_cache = draft.allocate_paged_cache(blocks, P, self.max_seq, self.device)
        else:
            self.target_cache = target.allocate_cache(a["cache_slots"], self.max_seq, self.device)
            self.draft_cache = draft.allocate_cache(a["cache_slots"], self.max_seq, self.device)
        self.caches = (self.target_cache.k, self.target_cache.v, self.draft_cache.k, self.draft_cache.v)
        # Sampling controls (an engine built with their steps, ``step_verify_ctl_b{B}``): per cache slot its
        # request's parameters and token history (``SpecPair.step_verify_ctl``), which the controlled steps
        # read and advance in place.
        self.controls = bool(a.get("sampling_controls"))
        self.ctl_state = None
        if self.controls:
            slots, V = a["cache_slots"], self.tcfg.vocab_size
            self.ctl_state = (torch.zeros(slots, len(CTL_FLOATS), device=self.device),
                              torch.zeros(slots, len(CTL_INTS), dtype=torch.int64, device=self.device),
                              torch.zeros(slots, V, dtype=torch.bool, device=self.device),
                              torch.zeros(slots, V, device=self.device),
                              torch.zeros(slots, V, dtype=torch.bool, device=self.device))

        pair = SpecPair(target, draft)
        specs = weight_specs(pair)
        if specs != a["weights"]:
            diff = next((m, h) for m, h in zip(a["weights"] + [None] * len(specs), specs + [None] * len(a["weights"]))
                        if m != h)
            raise EngineError(f"{engine_dir}: the weights do not match what the graphs were compiled for "
                              f"(manifest {diff[0]}, loaded {diff[1]})")
        self.weights = weight_tensors(pair, [w[0] for w in a["weights"]])

        d = Path(engine_dir)
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda and cuda_graphs
        if a.get("layout") != LAYOUT:
            older = ("one unrolled graph per step" if a.get("layout") is None
                     else f"the packages' layout {a.get('layout')!r}, this runtime's is {LAYOUT!r}")
            raise EngineError(f"{engine_dir}: this aoti engine was built by another muse-spark ({older}); rebuild it")
        self.buckets = [b for b in a["batch_buckets"] if b <= max_batch] or [min(a["batch_buckets"])]
        if self.buckets[-1] < max_batch:
            self.buckets.append(min(b for b in a["batch_buckets"] if b >= max_batch))
        words = {b: markov_words(a, b, engine_dir) for b in self.buckets}
        self.prefill_fn = load_prefill(d, a["graphs"], target, draft, self.device, loader=self.part_loader(d, a))
        self.prefill_fn.table = self.kv.table if self.kv is not None else None
        # up to prefill_batch chunks a call (the manifest's; 1: the single-chunk packages only)
        self.prefill_batch = prefill_batch(a, engine_dir)
        self.prefill_batch_fn = None
        if self.prefill_batch > 1:
            self.prefill_batch_fn = load_prefill(d, a["graphs"], target, draft, self.device,
                                                 loader=self.part_loader(d, a), batch=self.prefill_batch)
            self.prefill_batch_fn.table = self.prefill_fn.table
        self.runners: dict[int, StaticStep] = {}
        # (one pool and capture stream for all the engine's graphs: GraphMemory)
        memory = GraphMemory(self.device) if self.cuda_graphs else None
        self.pdl_kernels = programmatic_kernels(a) if self.cuda_graphs else ()
        with torch.inference_mode():
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool
                fn = load_step(d, a["graphs"], b, target, draft, self.device, single_threaded=self.cuda_graphs,
                               side_stream=self.options.context_stream, loader=self.part_loader(d, a),
                               widths=self.verify_widths, controls=self.controls)
                fn.table = self.kv.table if self.kv is not None else None
                if self.cuda_graphs:
                    self.runners[b] = CUDAGraphStep(fn, b, self.weights, self.caches, self.scratch_slot, self.device,
                                                    memory=memory, markov_words=words[b], programmatic=self.pdl_kernels,
                                                    split=self.schedules, ctl=self.ctl_state)
                else:
                    self.runners[b] = StaticStep(fn, b, self.weights, self.caches, self.scratch_slot, self.device,
                                                 markov_words=words[b], ctl=self.ctl_state)
        self.set_schedule(Schedule.from_dict(manifest.get("schedule")))

    # ---- confidence scheduling ---------------------------------------------------------------
    @property
    def schedules(self) -> bool:
        """Whether its steps can verify fewer drafts than γ: built with narrower verification widths
        (``build --verify-widths`` / ``--schedule confidence``)."""
        return len(self.verify_widths) > 1

    def set_schedule(self, schedule: Schedule) -> None:
        """``EagerEngine.set_schedule`` for the compiled step: a scheduled step runs the draft half,
        reads the confidences, and verifies the first K drafts of every request, K the plan's cut
        rounded up to a compiled width (the rows of a batch are padded to one width anyway, so every
        request verifies K: the batch shares one cut). ``fixed`` lengths must be compiled widths. A batch
        bucket whose cost row is flat (``Schedule.flat``: at batch 1 verification is nearly free) runs
        the plain full-width step."""
        if schedule.needs_confidence and self.draft.model.confidence_head is None:
            raise EngineError("schedule 'confidence' needs a draft with a confidence head "
                              "(enable_confidence_head in its config.json); this draft has none")
        if schedule.on and not self.schedules:
            raise EngineError(f"schedule {schedule.mode!r}: this {self.backend} engine's compiled step verifies every "
                              f"draft; rebuild it with narrower verification widths (build --verify-widths, or "
                              f"--schedule confidence)")
        if schedule.mode == "fixed" and schedule.length not in self.verify_widths:
            raise EngineError(f"schedule 'fixed' with {schedule.length} drafts: this engine's steps verify "
                              f"{self.verify_widths} drafts per request")
        self.schedule = schedule
        # a chained scheduled step's width before any plan: a fixed schedule's, else every draft
        first = max(self.verify_widths)
        if schedule.mode == "fixed":
            first = self._width(plan(None, schedule, 1, self.gamma)[1])
        for bucket, runner in getattr(self, "runners", {}).items():
            # (where the cost table is flat, the plain step: its width cannot pay for the plan)
            runner.planner = self._plan if schedule.on and not schedule.flat(bucket) else None
            runner.restart_plans(first)

    def _width(self, K: int) -> int:
        """The narrowest compiled verification width that holds K drafts (at least one)."""
        return next(w for w in self.verify_widths if w >= max(K, 1))

    def _plan(self, confidence: torch.Tensor, record: bool = True) -> int:
        """A scheduled step's width from its drafts' confidences ([n, γ] on the host); ``record``: they and the
        width are this step's info (``take_step_info``; not for a chained step's plan from an earlier step's)."""
        n = confidence.shape[0]
        K = self._width(plan(confidence, self.schedule, n, self.gamma)[1])
        if record:
            self._confidence = confidence
            self._verified = torch.full((n,), K, dtype=torch.int64)
        return K

    # ---- construction -----------------------------------------------------------------
    def part_loader(self, d: Path, section: dict):
        """Part name → the callable part; None: the AOTI packages (``load_step``'s default)."""
        return None

    @classmethod
    def check_section(cls, manifest: dict, where: str) -> None:
        """A backend's own refusals, after the common ones (``check_compatibility``)."""

    @classmethod
    def from_dir(cls, engine_dir: str | Path, device: str | None = None, dtype: str | None = None,
                 max_batch: int | None = None, cuda_graphs: bool = True,
                 options: KernelOptions | None = None, swap_space: float = SWAP_SPACE_GIB,
                 tp_rank: int | None = None) -> "AOTIEngine":
        """The engine at ``engine_dir`` (``EagerEngine.from_dir``'s kernel options: the manifest's, the
        run-scope ones from ``options`` or the environment). ``swap_space``: GiB of host memory for the K/V of
        requests preempted from a paged pool (``runtime/kv_blocks.py``). An engine built for tensor
        parallelism loads rank ``tp_rank``'s slice, whose packages all-reduce over the default process
        group (``runtime/tensor_parallel.py`` starts the ranks and the group, and joins the slice's eager
        modules to theirs)."""
        d = Path(engine_dir)
        m = read_manifest(d)
        if m["backend"] != cls.backend:
            raise EngineError(f"{d}: backend {m['backend']!r} is not an {cls.backend} engine")
        opts = engine_options(m, options, where=str(d))
        built_kind = m.get("device", {}).get("kind", "cpu")
        dev = torch.device(device or built_kind)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"{d}: engine device is cuda but no CUDA device is available")
        check_compatibility(m, machine_info(dev), str(d), cls.section)
        cls.check_section(m, str(d))
        pool = manifest_kv_pool(m[cls.section].get("kv_pool"), m["max_seq"], d, cls.section)
        if dtype is not None and parse_dtype(dtype) != parse_dtype(m["dtype"]):
            raise EngineError(f"{d}: an {cls.backend} engine runs in the dtype it was compiled for ({m['dtype']}), "
                              f"not {dtype}; rebuild it with --dtype {dtype}")
        if max_batch is not None and not 1 <= max_batch <= m["max_batch"]:
            raise EngineError(f"{d}: max_batch {max_batch} exceeds the engine's {m['max_batch']}")
        verify_files(d, m)
        check_plugins(m)
        tcfg, dcfg = configs_from_manifest(m)
        tcfg, target_file = target_slice(m, tcfg, tp_rank, d)
        dt = parse_dtype(m["dtype"])
        try:
            target_sd = load_file(str(d / target_file), device=str(dev))
            draft_sd = load_file(str(d / "draft.safetensors"), device=str(dev))
            target, draft = build_modules(tcfg, dcfg, target_sd, draft_sd, dt, dev)
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"{d}: engine weights cannot be loaded: {e}") from None
        # (one slot more than max_batch: the scratch slot padding rows write; paged: the pool's positions)
        if pool:
            check_cache_memory(d, tcfg, dcfg, dt, max_batch=1, max_seq=pool[0] * pool[1], device=dev)
        else:
            check_cache_memory(d, tcfg, dcfg, dt, max_batch=max_batch or m["max_batch"], max_seq=m["max_seq"],
                               device=dev, extra_slots=1)
        tok = d / m["tokenizer"] if m.get("tokenizer") else None
        return cls(target, draft, engine_dir=d, manifest=m, device=dev, max_batch=max_batch or m["max_batch"],
                   tokenizer_path=tok, cuda_graphs=cuda_graphs, options=opts, swap_space=swap_space)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.target.dtype)

    # ---- prefill -------------------------------------------------------------------------
    @with_options
    @torch.inference_mode()
    def prefill_chunks(self, chunks: list[PrefillChunk]) -> list[torch.Tensor | None]:
        """``EagerEngine.prefill_chunks`` on the compiled prefill: static chunks of ``prefill_chunk`` tokens (a
        prompt's last one padded), up to ``prefill_batch`` of them a call (the rows of a call that no chunk
        fills padded as a step's are: the scratch slot, greedy), one chunk a call where the engine has no
        batched prefill or too few chunks are left to fill more than half of one (``prefill_groups``)."""
        for c in chunks:  # (every chunk checked before any runs)
            L = len(c.prompt)
            if not 1 <= L < self.max_seq:
                raise ValueError(f"prompt length {L} must be in [1, max_seq={self.max_seq})")
            if not 0 <= c.slot < self.max_batch:
                raise ValueError(f"slot {c.slot} outside [0, {self.max_batch})")
        out: list[torch.Tensor | None] = []
        width = self.prefill_batch if self.prefill_batch_fn is not None else 1
        for i, j in prefill_groups(len(chunks), width):
            out += self._prefill_call(chunks[i:j], self.prefill_fn if j - i == 1 else self.prefill_batch_fn)
        return out

    def _prefill_call(self, group: list[PrefillChunk], fn) -> list[torch.Tensor | None]:
        """One call of the prefill ``fn`` (its packages' batch: 1 or ``prefill_batch``) over ``group``'s chunks."""
        dev, C = self.device, self.prefill_chunk
        rows = 1 if fn is self.prefill_fn else self.prefill_batch
        tokens = torch.zeros(rows, C, dtype=torch.int64)
        # Pad positions continue past the prompt (clamped into the window): no query of this prompt sees
        # them, and later steps overwrite them. Padding rows: the scratch slot at positions 0 … C − 1.
        positions = torch.arange(C).clamp_(max=self.max_seq - 1).repeat(rows, 1)
        slots = torch.full((rows,), self.scratch_slot, dtype=torch.int64)
        last = torch.zeros(rows, dtype=torch.int64)
        seeds = torch.zeros(rows, dtype=torch.int64)
        temps = torch.zeros(rows, dtype=torch.float32)
        n, done, controlled = [], [], []
        for j, c in enumerate(group):
            n.append(min(C, len(c.prompt) - c.start))
            tokens[j, : n[j]] = torch.tensor(c.prompt[c.start : c.start + n[j]], dtype=torch.int64)
            positions[j] = torch.arange(c.start, c.start + C).clamp_(max=self.max_seq - 1)
            slots[j], last[j], seeds[j], temps[j] = c.slot, n[j] - 1, c.seed, c.temperature
            done.append(c.start + n[j] == len(c.prompt))
            controlled.append(done[j] and (c.processing is not None or c.logprobs_n is not None))
        first = fn(self.weights, *self.caches, tokens.to(dev), positions.to(dev), slots.to(dev), last.to(dev),
                   seeds.to(dev), temps.to(dev), with_h=any(controlled))
        if any(controlled):  # (a first token under the request's controls: sampled here from the chunk's h)
            first, h = first
        out: list[torch.Tensor | None] = []
        for j, c in enumerate(group):
            if controlled[j]:
                (token,) = self._first_tokens(self.target.logits(h[j : j + 1, n[j] - 1]), [c])
            else:
                token = first[j : j + 1]
            out.append(token if done[j] else None)
        return out

    # ---- sampling controls -------------------------------------------------------------------
    @torch.inference_mode()
    def set_controls(self, slot: int, row: dict) -> None:
        """The sampling controls and token history of the request in ``slot`` (a ``Processing.build`` row:
        its parameters, prompt, output so far and stop ids), written into the slot's state for the
        controlled steps, which advance it on the device from then on."""
        if not self.controls:
            raise EngineError(f"this {self.backend} engine was built without the sampling controls' steps; rebuild it")
        proc = Processing.build([row], self.tcfg.vocab_size, self.device)
        floats, ints, seen, counts, stops = self.ctl_state
        floats[slot] = torch.stack([proc.top_p[0], proc.min_p[0], proc.repetition[0], proc.presence[0],
                                    proc.frequency[0]])
        ints[slot] = torch.stack([proc.top_k[0], proc.min_tokens[0], proc.out_len[0]])
        seen[slot], counts[slot], stops[slot] = proc.seen[0], proc.counts[0], proc.stops[0]

    # ---- speculative step ------------------------------------------------------------------
    def bucket_for(self, n: int) -> int:
        for b in sorted(self.runners):
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the engine's largest bucket {max(self.runners)}")

    @torch.inference_mode()
    def step(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, slots: torch.Tensor, seeds: torch.Tensor,
             temperature: torch.Tensor, kv_len: int) -> torch.Tensor:
        """``EagerEngine.step`` from the compiled graph of the smallest bucket that fits.
        ``kv_len`` only guards the window: the graph attends over [0, max_seq) with the position mask."""
        return self._runner(anchor.shape[0], kv_len)(anchor, anchor_pos, slots, seeds, temperature)

    @torch.inference_mode()
    def step_host(self, anchor, anchor_pos, slots, seeds, temperature, kv_len: int, processing=None,
                  logprobs_n: int | None = None) -> list[list[int]]:
        """``EagerEngine.step_host`` through the runner's pinned buffers: asynchronous host→device
        copies straight into the graph's static inputs, the replay, one device→host copy.
        ``processing`` (rows of the requests' controls) or ``logprobs_n``: the controlled step, which
        reads the controls from the slots' state (``set_controls``), at the full width; its
        log-probabilities for ``take_step_info``."""
        runner = self._runner(len(anchor), kv_len)
        if processing is None and logprobs_n is None:
            return runner.step_host(anchor, anchor_pos, slots, seeds, temperature)
        if not self.controls:
            raise EngineError(f"this {self.backend} engine was built without the sampling controls' steps; rebuild it")
        runner.controlled = True
        try:
            rows = runner.step_host(anchor, anchor_pos, slots, seeds, temperature)
        finally:
            runner.controlled = False
        if logprobs_n is not None:
            picked, values, ids = (t[: len(rows)] for t in runner.last_ctl)
            top = min(logprobs_n, values.shape[-1])
            self._logprobs = logprob_lists(picked, ids[..., :top] if top else None, values[..., :top] if top else None)
        return rows

    @property
    def chains(self) -> bool:
        """Whether the ``Generator`` chains this engine's steps (the next step launched before this one's rows are
        read: ``step_launch``/``step_next``/``step_rows``): the kernel option ``chained_steps`` of this engine
        (``self.options``). A chained scheduled step plans its width from an earlier step's confidences
        (``StaticStep._lagged``), so it never waits for its own; a step the ``Generator`` does not chain
        (``step_host``) plans from its own after its draft half."""
        return self.options.chained_steps

    @torch.inference_mode()
    def step_launch(self, anchor, anchor_pos, slots, seeds, temperature, kv_len: int) -> StepHandle:
        """``step_host`` without the wait → a handle for ``step_rows`` / ``step_next``."""
        return self._runner(len(anchor), kv_len).launch_host(anchor, anchor_pos, slots, seeds, temperature)

    @torch.inference_mode()
    def step_next(self, prev: StepHandle, kv_len: int) -> StepHandle:
        """The step after ``prev``, its inputs advanced on the device from ``prev``'s rows (the same
        requests in the same rows), launched before ``prev``'s rows are read (``StaticStep.launch_next``).
        ``kv_len``: ≥ the next step's largest position + γ + 1 (a guard: its writes stay in the caches)."""
        runner = self._runner(prev.n, kv_len)
        if runner is not prev.runner:
            raise ValueError("step_next: the step before ran in another batch bucket")
        return runner.launch_next(prev)

    @torch.inference_mode()
    def step_rows(self, h: StepHandle) -> list[list[int]]:
        """Wait for a launched step → its packed rows (``StaticStep.rows``; ``h.redone`` after a Markov
        kernel retry, when a step chained after ``h`` is invalid)."""
        return h.runner.rows(h)

    def _runner(self, n: int, kv_len: int) -> StaticStep:
        if kv_len > self.max_seq:
            raise ValueError(f"kv_len {kv_len} exceeds the engine's max_seq {self.max_seq}")
        runner = self.runners[self.bucket_for(n)]
        if isinstance(runner, CUDAGraphStep) and runner.live_caches is not self.caches:
            runner.check(self.caches)  # (the same lists: each replay checks their tensors, after its launch)
        return runner
