"""The ``aoti`` backend: ``torch.export`` + AOTInductor packages (docs/aoti.md).

An aoti engine directory holds, beside the canonical weights the eager
backend writes (``target.safetensors``, ``draft.safetensors``):

* ``prefill_layer.pt2``, ``prefill_finish.pt2`` — one prompt chunk of ``C``
  tokens for one request: a target layer, and the end of the chunk (draft
  context, first token); with ``prefill_batch`` P > 1 also ``prefill_layer_p{P}.pt2``,
  ``prefill_finish_p{P}.pt2``: the chunks of up to P requests in one pass over the weights;
* ``step_draft_b{B}.pt2``, ``step_layer_b{B}.pt2``, ``step_verify_b{B}.pt2``,
  ``step_context_b{B}.pt2`` — one speculative step for batch bucket ``B``
  (static shapes, so that the runtime can capture the step in a CUDA graph):
  the draft block and Markov loop, a target layer, verification/acceptance,
  and the draft context K/V of the block's tokens (which the runtime runs on a
  second stream beside the last layers and the verification).

The parts are ``muse_spark/graphs/parts.py``'s ``SpecPair`` functions, with the
weights and the KV caches as inputs (see that module for why). **One layer
package serves every target layer**: the layers share one structure and their
weights are inputs, so a 32-layer target compiles one layer, not 32 unrolled
(compile time and package size stop growing with depth); the runtime calls it
once per layer, and on CUDA the whole sequence is captured in one CUDA graph.

Footguns this module handles:

* **No weights are needed to compile.** Each graph is exported from modules on
  the meta device with fake inputs of the recorded weight shapes/dtypes, so a
  compile worker is cheap to start and an 8B build does not hold 16 GB per
  worker. The graphs compile in parallel worker processes (``spawn``: a
  forked CUDA context is unusable), because Inductor's code generation is
  single-threaded Python and a large step graph takes minutes.
* **Plugins.** CPU builds (and CUDA builds without Triton kernels) export with
  ``plugin_impl("inline")``: the reference functions are traced into the graph,
  so the package needs no Python-registered op at run time (CPU AOTI and the C++
  loader require that). CUDA builds use ``"triton"`` when
  ``muse_spark.plugins.triton_ops`` imports: its ``triton_op`` kernels are
  compiled into the package. The manifest records which.
* **Inductor's 32-bit indexing** (torch 2.11 and 2.13): the keyed random
  hash multiplies an ``arange`` by the 32-bit golden ratio 0x9E3779B9;
  Inductor turns that into an index expression ``2654435769*r0_0`` and, when a
  kernel is small enough for int32 indexing, emits it in int32, which Triton
  rejects ("Scalar 2654435769 is out of range for type int32"). The compile
  therefore forces 64-bit indexing (``int64_indexing``), which Inductor
  documents as always correct; the kernels are memory-bound, so the wider index
  math costs little.
* **Concurrent compiles of one graph.** AOTI packages a compile's files after releasing the
  cache lock under which another process compiling the same code rewrites them: a bench
  variant whose switch changes no code (PDL on CPU) compiled beside the default got a package
  with an empty ``_metadata.json``. Each set of kernel options compiles in its own Inductor cache
  folder (``variant_cache_dir``) and every package is checked after its compile (``check_package``).
* **Kernel options.** The build's ``KernelOptions`` (``muse_spark/options.py``) travel in every
  compile job (``job["options"]``, a dict); the worker traces and compiles under
  ``use_options``. The manifest's ``aoti`` section records what they made of this build (the
  kernels each path takes on this device).
* **CPU compile time.** Inductor's C++ code generation emits vectorized and
  scalar variants of every kernel; for the sampling kernels (keyed hashes,
  softmax, argmax fused over the Markov loop) that is minutes of Python on a
  small machine. ``fast_compile`` (the CPU default: CPU engines serve tests
  and CI) turns vectorization off, about halving it.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterator

import torch

from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig
from muse_spark.models.layers import Fp8Linear, attention_path, linear_path
from muse_spark.plugins.pdl import pdl_active, PDL_KERNELS
from muse_spark.options import KernelOptions, use_options
from muse_spark.builder.package_cache import PackageCache, check_package, open_cache
from muse_spark.graphs.parts import (CTL_FLOATS, CTL_INTS, GRAPH_INPUTS, LAYOUT, LOGPROBS_TOP, GraphFn, SpecPair,
                                     build_pair, part_weight_names, torch_dtype, weight_specs)

PLUGIN_IMPLS = ("auto", "inline", "triton")


def resolve_plugin_impl(requested: str, device: str) -> str:
    """``auto`` → ``triton`` on CUDA when the Triton ops import, else ``inline``."""
    if requested not in PLUGIN_IMPLS:
        raise ValueError(f"unknown plugin implementation {requested!r} (expected one of {list(PLUGIN_IMPLS)})")
    cuda = torch.device(device).type == "cuda"
    if requested == "triton" and not cuda:
        raise ValueError("plugin implementation 'triton' needs --device cuda (CPU builds run the references)")
    if requested != "auto":
        if requested == "triton":
            import muse_spark.plugins.triton_ops  # noqa: F401  (fails loudly if it cannot)
        return requested
    if not cuda:
        return "inline"
    try:
        import muse_spark.plugins.triton_ops  # noqa: F401
    except Exception as e:  # Triton missing or the kernels module broken: stay exact
        print(f"[build] Triton plugin kernels unavailable ({type(e).__name__}: {e}); using the references",
              file=sys.stderr, flush=True)
        return "inline"
    return "triton"


def graph_plan(device: str, max_batch: int, max_seq: int, buckets: list[int] | None,
               prefill_chunk: int | None) -> tuple[list[int], int]:
    """Batch buckets (CUDA: powers of two up to max_batch; CPU: just max_batch) and the prefill chunk."""
    if buckets is None:
        if torch.device(device).type == "cuda":
            buckets, b = [], 1
            while b < max_batch:
                buckets.append(b)
                b *= 2
            buckets.append(max_batch)
        else:
            buckets = [max_batch]
    buckets = sorted(set(int(b) for b in buckets))
    if not buckets or buckets[0] < 1 or buckets[-1] != max_batch:
        raise ValueError(f"batch buckets {buckets} must be positive and end at --max-batch {max_batch}")
    chunk = prefill_chunk or min(128, max_seq)
    if not 1 <= chunk <= max_seq:
        raise ValueError(f"prefill chunk {chunk} must be in [1, max_seq={max_seq}]")
    return buckets, chunk


def inductor_configs(device: str, fast_compile: bool) -> dict:
    """Inductor options for a graph compile.

    The engine must reproduce the eager engine token for token, so keep eager's
    bf16 rounding between fused ops (``emulate_precision_casts``; by default
    Inductor elides those downcast-upcast pairs: on the CPU too, where an FP8 KV
    cache's write then quantized the norm's unrounded keys) and, on CUDA, eager's
    correctly-rounded division where this torch has the knob. CPU: see also
    ``fast_compile`` in the module docstring.
    """
    import torch._inductor.config as c

    out = {}
    if hasattr(c, "emulate_precision_casts"):
        out["emulate_precision_casts"] = True
    if torch.device(device).type == "cpu":
        return {**out, "cpp.vec_isa_ok": False} if fast_compile else out
    if hasattr(getattr(c, "eager_numerics", None), "division_rounding"):
        out["eager_numerics.division_rounding"] = True
    return out


def width_suffix(K: int | None) -> str:
    """The package-name suffix of verification width ``K`` (None: the full width γ, no suffix)."""
    return "" if K is None else f"_k{K}"


def prefill_suffix(batch: int) -> str:
    """The package-name suffix of the prefill for ``batch`` chunks at once (1: none)."""
    return "" if batch == 1 else f"_p{batch}"


def graph_plan_names(buckets: list[int], with_prefill: bool = True, widths: list[int] = (),
                     controls: bool = False, prefill_batch: int = 1) -> list[tuple[str, str, int, int | None]]:
    """(graph name, SpecPair function, batch, verification width) of every package an engine holds.
    ``widths``: the narrower verification widths K < γ (each bucket gets a layer, verify and context
    package per width, ``_k{K}``); the width is None for the prefill, the draft and the full width.
    ``controls``: each bucket's verification under the sampling controls too (``step_verify_ctl_b{B}``).
    ``prefill_batch`` P > 1: a prefill for P chunks at once beside the one for a single chunk (``_p{P}``)."""
    names = []
    if with_prefill:
        for p in sorted({1, prefill_batch}, reverse=True):
            names += [(f"prefill_layer{prefill_suffix(p)}", "layer", p, None),
                      (f"prefill_finish{prefill_suffix(p)}", "prefill_finish", p, None)]
    for b in sorted(buckets, reverse=True):  # the largest compiles longest: start it first
        names += [(f"step_verify_b{b}", "step_verify", b, None), (f"step_draft_b{b}", "step_draft", b, None),
                  (f"step_layer_b{b}", "layer", b, None), (f"step_context_b{b}", "step_context", b, None)]
        if controls:
            names.append((f"step_verify_ctl_b{b}", "step_verify_ctl", b, None))
        for K in sorted(widths, reverse=True):
            names += [(f"step_{part}_b{b}{width_suffix(K)}", fn, b, K)
                      for part, fn in (("verify", "step_verify"), ("layer", "layer"), ("context", "step_context"))]
    return names


def check_prefill_batch(prefill_batch: int, max_batch: int) -> int:
    """The prompt chunks one prefill call takes, checked: an integer in [1, max_batch]."""
    if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= max_batch:
        raise ValueError(f"prefill batch {prefill_batch!r} must be an integer in [1, max_batch={max_batch}] (prompt "
                         "chunks one prefill call takes)")
    return prefill_batch


def check_widths(widths: list[int] | str | None, gamma: int) -> list[int]:
    """The narrower verification widths an engine is built with, sorted (γ itself is always there
    and is left out; ``"default"``: 1 and about γ/2); a width outside [1, γ] is refused."""
    if widths == "default":
        widths = [1, (gamma + 1) // 2]
    widths = sorted(set(int(k) for k in widths or ()))
    bad = [k for k in widths if not 1 <= k <= gamma]
    if bad:
        raise ValueError(f"verification widths {bad}: each must be in [1, γ={gamma}] (drafts verified per request)")
    return [k for k in widths if k < gamma]


def graph_jobs(tcfg: MuseSpark1xConfig, dcfg: MuseSparkDSparkConfig, wspecs: list[list], *, device: str,
               max_seq: int, cache_slots: int, buckets: list[int], prefill_chunk: int, impl: str,
               cache_dtype: str, configs: dict, out_dir: Path, with_prefill: bool = True,
               markov_words: dict[int, int] | None = None, options: KernelOptions | None = None,
               widths: list[int] = (), controls: bool = False, kv_pool: list[int] | None = None,
               tp: dict | None = None, prefill_batch: int = 1) -> list[dict]:
    """One self-contained job per package (picklable: a worker rebuilds everything from it).
    ``markov_words``: the Markov kernel's kept workspace per batch bucket (``markov_workspaces``);
    ``options``: the kernel options the graphs are traced under (default: the defaults);
    ``widths``, ``controls``: the narrower verification widths, the controlled verification
    (``graph_plan_names``, as is ``prefill_batch``); ``kv_pool``: [blocks, block size] of paged caches (the parts then take the
    rows' block tables where they take their slots); ``tp``: {"world", "vocab"} of a tensor-parallel rank's
    graphs (``tcfg`` that rank's share; ``split_pair``)."""
    names = [w[0] for w in wspecs]
    common = dict(tcfg=tcfg.to_dict(), dcfg=dcfg.to_dict(), device=device, max_seq=max_seq,
                  cache_slots=cache_slots, cache_dtype=cache_dtype, impl=impl, configs=configs,
                  options=(options or KernelOptions()).to_dict(), kv_pool=kv_pool, tp=tp)
    jobs = []
    spec = {w[0]: w for w in wspecs}
    for name, fn, batch, K in graph_plan_names(buckets, with_prefill, widths, controls, prefill_batch):
        tokens = prefill_chunk if name.startswith("prefill") else (dcfg.block_size if K is None else K) + 1
        jobs.append(dict(common, name=name, fn=fn, batch=batch, tokens=tokens, width=K,
                         markov_words=(markov_words or {}).get(batch, 0),  # in the runtime's feed order
                         weights=[spec[n] for n in part_weight_names(names, fn)], out=str(out_dir / f"{name}.pt2")))
    return jobs


def fake_inputs(job: dict, tcfg, dcfg):
    """Fake tensors for (weights, *inputs) of one job's part (``SpecPair`` documents the shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device(job["device"])
    cache_dtype = torch_dtype(job["cache_dtype"])  # the compute dtype (the normed inputs x and h have it too)
    i64, f32 = torch.int64, torch.float32
    B, S, D, g = job["batch"], job["tokens"], tcfg.hidden_size, dcfg.block_size
    with FakeTensorMode():
        def t(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=dev)

        pool = job.get("kv_pool")  # paged: [blocks, P]

        def cache(cfg):  # (the target's: E4M3 for an FP8 KV cache)
            rows, length = pool if pool else (job["cache_slots"], job["max_seq"])
            return t((rows, length, cfg.num_key_value_heads, cfg.head_dim), cfg.cache_dtype(cache_dtype))

        def rows(n):  # the cache rows of n requests: slots [n], or block tables [n, ⌈max_seq / P⌉]
            return t((n, -(-job["max_seq"] // pool[1])) if pool else (n,), i64)

        weights = [t(shape, torch_dtype(dt)) for _, shape, dt in job["weights"]]
        fn = job["fn"]
        if fn == "layer":
            return (weights, cache(tcfg), cache(tcfg), t((B, S, D), f32), t((B, S, D), cache_dtype),
                    t((B, S), i64), rows(B))
        dk = [cache(dcfg) for _ in range(dcfg.num_hidden_layers)]
        dv = [cache(dcfg) for _ in range(dcfg.num_hidden_layers)]
        aux = [t((B, S, D), f32) for _ in dcfg.target_layer_ids]
        if fn == "step_draft":
            return (weights, dk, dv, t((job["markov_words"],), i64), *[t((B,), i64) for _ in range(2)], rows(B),
                    t((B,), i64), t((B,), f32), t((B, S), i64))
        if fn == "step_context":
            return (weights, dk, dv, aux, t((B, S), i64), rows(B))
        h = t((B, S, D), cache_dtype)
        if fn in ("step_verify", "step_verify_ctl"):
            args = (weights, t((job["markov_words"],), i64), h, t((B, g), i64), t((B, g, dcfg.draft_vocab_size), f32),
                    t((B, S), i64), t((B,), i64), t((B,), f32))
            if fn == "step_verify":
                return args
            slots, V = job["cache_slots"], tcfg.vocab_size
            return (*args, t((B,), i64), t((slots, len(CTL_FLOATS)), f32), t((slots, len(CTL_INTS)), i64),
                    t((slots, V), torch.bool), t((slots, V), f32), t((slots, V), torch.bool))
        if fn == "prefill_finish":
            return (weights, dk, dv, h, aux, t((B, S), i64), rows(B), *[t((B,), i64) for _ in range(2)],
                    t((B,), f32))
    raise ValueError(f"unknown graph function {fn!r}")


@contextlib.contextmanager
def int64_indexing() -> Iterator[None]:
    """Make Inductor index every Triton kernel in int64 (see the module docstring)."""
    from torch._inductor.codegen.simd import SIMDScheduling

    original = SIMDScheduling.__dict__.get("can_use_32bit_indexing")
    if original is None:  # a torch without this hook: nothing to patch
        yield
        return
    SIMDScheduling.can_use_32bit_indexing = staticmethod(lambda numel, buffers: False)
    try:
        yield
    finally:
        SIMDScheduling.can_use_32bit_indexing = original


def compile_job(job: dict) -> dict:
    """Export one graph from meta modules and compile it into an AOTI package. (Worker entry point.)

    Failures come back as a ``RuntimeError`` carrying the formatted traceback: the
    original exception (a Triton ``CompilationError`` holds frames) may not pickle."""
    try:
        options = job_options(job)
        with use_options(options), variant_cache(options):
            # (a copy: aoti_compile_and_package writes its own keys into the inductor_configs dict it is given)
            return _compile_job(copy.deepcopy(job))
    except Exception as e:
        tb = traceback.format_exc()
        raise RuntimeError(f"{type(e).__name__}: {e}\n{tb[-6000:]}") from None


def job_options(job: dict) -> KernelOptions:
    """A compile job's kernel options (``job["options"]``, ``KernelOptions.to_dict()``; missing: the
    defaults). A job that names ``env`` is refused: kernel options are not environment variables."""
    if "env" in job:
        raise ValueError(f"compile job {job.get('name')!r}: kernel options go in job['options'] "
                         "(KernelOptions.to_dict(); KernelOptions.from_env turns a dict of variables into "
                         "options), not job['env']")
    return KernelOptions.from_dict(job.get("options") or {}, f"compile job {job.get('name')!r}")


def variant_cache_dir(options: KernelOptions) -> str | None:
    """The Inductor cache folder of a job compiled under ``options``: a folder of its own under
    Inductor's cache (named by the options that differ from the defaults), None for the defaults.

    A variant whose options change nothing in a graph (PDL on CPU) generates the very code of the
    default, so two workers compiling both at once write the same files of Inductor's cache. AOTI
    packaging reads the wrapper's ``_metadata.json`` back after releasing the lock under which the
    other worker is truncating and rewriting it: the package then holds an empty JSON and fails to
    load (seen in CI). Separate folders keep the variants apart and the cache reusable per variant."""
    changed = options.changed()
    if not changed:
        return None
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    name = "variant-" + "-".join(f"{k}={v}" for k, v in sorted(changed.items()))
    return os.path.join(cache_dir(), name)


def variant_cache(options: KernelOptions):
    """Inductor's cache in ``variant_cache_dir(options)`` for the block (torch's own
    ``temporary_cache_dir``), or as it is for the defaults."""
    folder = variant_cache_dir(options)
    if folder is None:
        return contextlib.nullcontext()
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(folder)


def install_fp8(pair, names: list[str], dtype: torch.dtype) -> None:
    """An ``Fp8Linear`` (on meta) in the export modules for every projection whose weights the graphs read in
    FP8 (its ``weight_scale`` among ``names``), as ``checkpoint.materialize`` installs them in the runtime's:
    the traced projection then dequantizes its weight (``layers.linear``) instead of multiplying by FP8."""
    for name in names:
        if name.endswith(".weight_scale"):
            path = name.removesuffix(".weight_scale")
            with torch.device("meta"):
                Fp8Linear.install(pair, path, dtype, static=f"{path}.input_scale" in names)


def split_pair(pair, tp: dict, shapes: dict[str, list[int]]) -> None:
    """Make the export modules one tensor-parallel rank's (``tp``: {"world", "vocab"}): its layers all-reduce,
    and its lm_head (a vocabulary slice where ``vocab``: the rows ``shapes`` records) gathers, over the default
    process group. Tracing a collective needs that group to exist: a compile worker has no ranks, so it
    registers torch's fake process group of ``world`` ranks (the same default group name, "0", a rank's package
    then resolves on the real group: gloo or NCCL). The packages are the same for every rank: a rank's weights
    are inputs, and every rank's slice has the same shapes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from muse_spark.sharding import set_group

    if dist.is_initialized() and dist.get_world_size() != int(tp["world"]):
        raise RuntimeError(f"tracing a rank of {tp['world']} in a process whose default group has "
                           f"{dist.get_world_size()} ranks")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(tp["world"]))
    if tp["vocab"] and "target.lm_head.weight" in shapes:  # (the parts that read the head)
        rows, cols = shapes["target.lm_head.weight"]
        with torch.device("meta"):
            pair.target.lm_head = torch.nn.Linear(cols, rows, bias=False)
    set_group(pair.target, dist.group.WORLD, bool(tp["vocab"]))


def _compile_job(job: dict) -> dict:
    from muse_spark.plugins.dispatch import plugin_impl

    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    t0 = time.perf_counter()
    if job.get("compile_threads"):
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = job["compile_threads"]
    tcfg = MuseSpark1xConfig.from_dict(job["tcfg"], "target config")
    dcfg = MuseSparkDSparkConfig.from_dict(job["dcfg"], "draft config")
    if job["impl"] == "triton":
        import muse_spark.plugins.triton_ops  # noqa: F401
    pair = build_pair(tcfg, dcfg)
    names = [w[0] for w in job["weights"]]
    if job.get("tp"):
        split_pair(pair, job["tp"], {w[0]: w[1] for w in job["weights"]})
    install_fp8(pair, names, torch_dtype(job["cache_dtype"]))
    args = fake_inputs(job, tcfg, dcfg)
    with plugin_impl(job["impl"]):
        ep = torch.export.export(GraphFn(pair, job["fn"], names), args, strict=False)
    t1 = time.perf_counter()
    with int64_indexing():
        torch._inductor.aoti_compile_and_package(ep, package_path=job["out"], inductor_configs=job["configs"])
    if job.get("tp") and torch.distributed.get_backend() == "fake":  # (split_pair's, in a compile process)
        torch.distributed.destroy_process_group()
    check_package(job["out"])
    return {"name": job["name"], "file": Path(job["out"]).name, "fn": job["fn"], "batch": job["batch"],
            "tokens": job["tokens"], "width": job.get("width"), "export_s": round(t1 - t0, 1),
            "compile_s": round(time.perf_counter() - t1, 1)}


def markov_workspaces(impl: str, device: str, draft, vocab: int, buckets: list[int]) -> dict[int, int]:
    """int64 words of the fused Markov kernel's kept workspace per batch bucket (the step_draft
    package's ``markov_ws`` input, recorded in the manifest for the runtime to allocate); 0 where
    the package runs the reference loop."""
    if impl != "triton":
        return {b: 0 for b in buckets}
    from muse_spark.plugins.triton_ops import markov_workspace_words

    c, mh = draft.cfg, draft.model.markov_head
    return {b: markov_workspace_words(b, c.block_size, c.draft_vocab_size, vocab, c.markov_rank, mh.head_type,
                                      torch.device(device), mh.markov_w1.weight.dtype) for b in buckets}


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel queued jobs and terminate running workers (``shutdown`` alone would wait for them)."""
    for p in list(getattr(pool, "_processes", {}).values()):  # CPython's ProcessPoolExecutor internals
        p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def cached_result(job: dict) -> dict:
    """``compile_job``'s result for a job whose package came from the build cache."""
    return dict(name=job["name"], file=Path(job["out"]).name, fn=job["fn"], batch=job["batch"], tokens=job["tokens"],
                width=job.get("width"), export_s=0.0, compile_s=0.0, cached=True)


def compile_job_cached(job: dict, build_cache: str | None = None) -> dict:
    """``compile_job`` through the build cache ``build_cache`` names (``package_cache.open_cache``): the
    worker entry point of callers that run their own pool of compiles (``benchmarks/step.py``)."""
    cache = open_cache(build_cache, job["device"])
    if cache is not None and cache.take(job):
        return cached_result(job)
    result = compile_job(job)
    if cache is not None:
        cache.store(job)
    return result


def compile_graphs(jobs: list[dict], workers: int | None = None,
                   log: Callable[[str], None] = lambda m: None, cache: PackageCache | None = None) -> list[dict]:
    """Compile every job, in ``workers`` spawned processes (1: in this process). With a build ``cache``
    (``package_cache``), a job compiled before takes its stored package instead (its result says
    ``cached``), and each package compiled is stored as soon as it is done."""
    if not jobs:
        return []
    results = []
    if cache is not None:
        hits, misses = [], []
        for j in jobs:
            (hits if cache.take(j) else misses).append(j)
        results = [cached_result(j) for j in hits]
        if hits:
            log(f"{len(hits)} of {len(jobs)} graphs from the build cache ({cache.root}): "
                f"{', '.join(j['name'] for j in hits)}")
        jobs = misses
        if not jobs:
            return sorted(results, key=lambda r: r["name"])

    def done(job: dict, r: dict) -> None:
        results.append(r)
        if cache is not None:
            cache.store(job)  # (compile_job compiles a copy: the job is as it was keyed)

    workers = max(1, min(workers or len(jobs), len(jobs)))
    threads = max(1, (os.cpu_count() or 1) // workers)
    jobs = [dict(j, compile_threads=threads) for j in jobs]
    t0 = time.perf_counter()
    if workers == 1:
        for i, job in enumerate(jobs, 1):
            log(f"compiling {job['name']} ({i}/{len(jobs)})")
            done(job, compile_job(job))
            log(f"{job['name']} compiled in {time.perf_counter() - t0:.0f}s")
        return sorted(results, key=lambda r: r["name"])
    log(f"compiling {len(jobs)} graphs ({', '.join(j['name'] for j in jobs)}) in {workers} worker processes")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending = {pool.submit(compile_job, j): j for j in jobs}
        n = len(results)  # (taken from the cache)
        while pending:
            finished, _ = wait(pending, timeout=30, return_when=FIRST_COMPLETED)
            if not finished:
                log(f"… still compiling {', '.join(pending[f]['name'] for f in pending)} "
                    f"({time.perf_counter() - t0:.0f}s)")
            for f in finished:
                job = pending.pop(f)
                try:
                    r = f.result()
                except Exception as e:
                    _stop(pool)  # the other graphs would only finish (or fail) for nothing
                    raise RuntimeError(f"compiling {job['name']} failed: {type(e).__name__}: {e}") from e
                done(job, r)
                log(f"{r['name']} compiled (export {r['export_s']}s, AOTInductor {r['compile_s']}s; "
                    f"{len(results) - n}/{len(jobs)} after {time.perf_counter() - t0:.0f}s)")
    return sorted(results, key=lambda r: r["name"])


def build_aoti(target, draft, out_dir: Path, *, device: str, max_batch: int, max_seq: int,
               buckets: list[int] | None = None, prefill_chunk: int | None = None, fast_compile: bool | None = None,
               plugins: str = "auto", jobs: int | None = None, log: Callable[[str], None] = lambda m: None,
               options: KernelOptions | None = None, verify_widths: list[int] | None = None,
               sampling_controls: bool = True, kv_pool: list[int] | None = None, tp: dict | None = None,
               prefill_batch: int = 1, build_cache: str | None = None) -> dict:
    """Compile the prefill and step packages into ``out_dir`` under the kernel ``options`` (default:
    the defaults); → the manifest's ``aoti`` section. ``verify_widths``: verification widths K < γ
    to compile step packages for beside the full width (confidence-scheduled steps verify the first
    K drafts of every row; ``muse_spark/schedule.py``). ``sampling_controls``: compile each bucket's
    verification under the requests' sampling controls too (``SpecPair.step_verify_ctl``). ``kv_pool``:
    [blocks, block size]: paged caches, a pool of that many blocks (``runtime/kv_blocks.py``), which the
    parts address through block tables. ``tp``: {"world", "vocab"}: ``target`` is one tensor-parallel rank's
    slice (``shard_target``), whose packages every rank runs on its own slice (``split_pair``).
    ``prefill_batch`` P > 1: a prefill package for P prompt chunks at once beside the one for a single chunk
    (the runtime prefills a round of up to P requests' chunks in one pass over the weights). ``build_cache``:
    the build cache's folder or ``off`` (default: the build-cache variable's, else the user's cache folder;
    ``package_cache``): graphs compiled before, for this device with these sources, are taken from it."""
    options = options or KernelOptions()
    prefill_batch = check_prefill_batch(prefill_batch, max_batch)
    buckets, chunk = graph_plan(device, max_batch, max_seq, buckets, prefill_chunk)
    widths = check_widths(verify_widths, draft.cfg.block_size)
    if fast_compile is None:
        fast_compile = torch.device(device).type == "cpu"
    impl = resolve_plugin_impl(plugins, device)
    attention, linear = attention_path(device, target.dtype, options), linear_path(device, target.dtype, options)
    log(f"plugins: {impl}; attention: {attention}; linear: {linear}; batch buckets {buckets}; "
        f"verification widths {widths + [draft.cfg.block_size]}; prefill chunk {chunk}; static key window {max_seq}")
    if impl == "triton" and draft.cfg.dspark_draft_topk:
        raise ValueError("the fused Markov kernel does not support dspark_draft_topk; build with plugins='inline'")
    wspecs = weight_specs(SpecPair(target, draft))
    configs = inductor_configs(device, fast_compile)
    cache_dtype = str(target.dtype).removeprefix("torch.")
    cache = open_cache(build_cache, device, log)

    def compile_with(impl: str) -> tuple[list[dict], dict[int, int]]:
        words = markov_workspaces(impl, device, draft, target.cfg.vocab_size, buckets)
        job_list = graph_jobs(target.cfg, draft.cfg, wspecs, device=device, max_seq=max_seq,
                              cache_slots=max_batch + 1, buckets=buckets, prefill_chunk=chunk, impl=impl,
                              cache_dtype=cache_dtype, configs=configs, out_dir=out_dir, markov_words=words,
                              options=options, widths=widths, controls=sampling_controls, kv_pool=kv_pool, tp=tp,
                              prefill_batch=prefill_batch)
        return compile_graphs(job_list, jobs, log, cache=cache), words

    fallback = None
    try:
        results, words = compile_with(impl)
    except RuntimeError as e:
        if not (plugins == "auto" and impl == "triton"):
            raise
        # The Triton plugin kernels import but do not compile into a package: say so,
        # record it, and build the exact reference path instead.
        fallback = str(e).splitlines()[0][:500]
        log(f"the Triton plugin kernels failed to compile into the package ({fallback}); "
            f"rebuilding with the reference plugins (plugin_impl 'inline')")
        impl = "inline"
        results, words = compile_with(impl)
    graphs = {r["name"]: {"file": r["file"], "fn": r["fn"], "batch": r["batch"], "tokens": r["tokens"]}
              for r in results}
    for r in results:
        if r.get("width") is not None:
            graphs[r["name"]]["width"] = r["width"]
    # options.pdl (CUDA builds with the Triton plugins on sm_90+): these kernels wait first, and the step
    # graphs launch them as PDL dependents
    pdl = pdl_active(options) and impl == "triton" and torch.device(device).type == "cuda"
    return {
        "layout": LAYOUT,
        "plugin_impl": impl,
        "plugin_fallback": fallback,
        # what the kernel options (the manifest's "options") made of this build, path by path
        "attention_kernel": attention,
        "linear_kernel": linear,
        # options.attention_cache: the attention kernel norms q/k and writes the caches
        "attention_cache": options.attention_cache and attention == "triton",
        # options.accept_kernels: step_verify's acceptance rule in three Triton kernels
        "accept_kernels": options.accept_kernels and impl == "triton",
        # options.attention_splits (0: the launcher's choice): splits of the window an attention program runs
        "attention_splits": options.attention_splits if attention == "triton" else None,
        # options.rope_table: the qkv GEMM's launch writes the RoPE table the norm kernel reads
        "rope_table": options.rope_table and linear == "triton",
        "pdl_kernels": list(PDL_KERNELS) if pdl else [],
        # options.pdl_trigger (with PDL): the small kernels trigger their dependents first
        "pdl_trigger": pdl and options.pdl_trigger,
        # options.pdl_gemm_trigger (with PDL): the GEMMs trigger their dependents after their weight stream
        "pdl_gemm_trigger": pdl and options.pdl_gemm_trigger,
        "graphs": graphs,
        "batch_buckets": buckets,
        # the verification widths the step packages were compiled for (drafts verified per request; γ: all)
        "verify_widths": widths + [draft.cfg.block_size],
        # the sampling controls' steps (step_verify_ctl_b{B}): the alternatives a position reports at most
        "sampling_controls": {"logprobs_top": LOGPROBS_TOP} if sampling_controls else None,
        # The fused Markov kernel's kept workspace per bucket: int64 words the runtime zeroes once
        # (the step_draft package's markov_workspace input; 0: the reference loop, an empty tensor)
        "markov_workspace_words": {str(b): n for b, n in words.items()},
        "prefill_chunk": chunk,
        # prompt chunks one prefill package call takes at most (prefill_layer_p{P}, prefill_finish_p{P}; 1: none)
        "prefill_batch": prefill_batch,
        # Caches have one slot more than max_batch: padded batch rows read and write it.
        "cache_slots": max_batch + 1,
        # paged caches: [blocks, block size] of the pool the parts address through block tables; null: a
        # window of max_seq positions per slot
        "kv_pool": list(kv_pool) if kv_pool else None,
        "scratch_slot": max_batch,
        "cache_dtype": cache_dtype,
        "weights": wspecs,
        # For an embedder: each part's flat input order. "weights[head]" is every weight outside
        # target.model.layers.*, "weights[layer i]" layer i's, both in the order of "weights".
        "graph_inputs": GRAPH_INPUTS,
        "compile": {"fast_compile": fast_compile, "inductor_configs": configs,
                    "seconds": {r["name"]: r["export_s"] + r["compile_s"] for r in results},
                    # the graphs taken from the build cache (compiled by an earlier build: builder/package_cache.py)
                    "cached": sorted(r["name"] for r in results if r.get("cached"))},
    }
