"""``muse-spark bench``: speculative-step latency of the eager, torch.compile and aoti engines.

On the GPU with the Muse-Spark-shaped preset (random bf16 weights; DESIGN.md §7)
one run measures, at each batch size:

* the speculative step (draft block → Markov loop → target verify → accept →
  draft context) of (a) the eager engine, (b) ``torch.compile`` of the same
  eager step (``mode="reduce-overhead"``, gpt-fast's method: CUDA graphs, the
  caches marked as static addresses), (c) the aoti engine's step graph replayed
  from a CUDA graph (the runner the runtime uses: input copies and all);
* the fused Markov loop alone (the engine's plugin implementation, and the
  reference loop), each replayed from a CUDA graph;
* the bytes a step must read (weights + valid KV) against a device-to-device
  copy bandwidth it measures itself: roofline time and achieved fraction;
* tokens/s at mean acceptance lengths τ = 1, 3.7, 6.17 (tokens per step,
  bonus included): B·τ / step time.

Timing: CUDA events around each call, warm-up first, median of ``iters``
(METHOD.md). KV caches hold random values at ``context`` positions per request
(never zeros). The aoti step graphs compile in worker processes while the
torch.compile baseline compiles; eager timings are taken before either starts
(an eager step is launch-bound and CPU contention would inflate it).

Results go to JSON and a Markdown table (``docs/benchmarks.md``) together with
the exact command. Partial JSON is written after every section, so a run cut
short still reports what it measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

PRESETS = {
    # DESIGN.md §7 / the issue: an 8B-shaped dense target and a 5-layer DSpark draft.
    "muse-spark-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=131072,
                          draft_layers=5, draft_vocab=32768, rank=256, gamma=7, aux=(1, 8, 15, 22, 29)),
    # Same code paths at toy size (CPU smoke runs, CI).
    "tiny": dict(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                 draft_layers=1, draft_vocab=128, rank=16, gamma=3, aux=(0, 1)),
}
TAUS = (1.0, 3.7, 6.17)
# aoti step variants `--attention-cache both` / `--pdl both` / `--pdl-trigger both` / `--rope-table both` /
# `--linear-residual both` / `--accept-kernels both` / `--attention-splits both`
# compile and time beside the default: name -> the kernel switches set in its compile workers and around the eager
# step it is checked against. A step compiled with PDL (the default on sm_90+) gets its graphs' programmatic
# edges (runtime.cuda_graph.make_programmatic), as the engine does. The RoPE table (thirteenth session), the
# fused attention (fourteenth), PDL with the small kernels' trigger (fifteenth), the acceptance kernels
# (twentieth) and the GEMMs' late trigger (twenty-first) are the defaults: their variants are the step without them;
# likewise several splits of the window an attention program (twenty-fourth; the variant: one split a program).
VARIANTS = {"no_attention_cache": {"MUSE_SPARK_ATTENTION_CACHE": "0"}, "no_pdl": {"MUSE_SPARK_PDL": "0"},
            "pdl_wait_only": {"MUSE_SPARK_PDL_TRIGGER": "0"},
            "no_rope_table": {"MUSE_SPARK_ROPE_TABLE": "0"}, "linear_residual": {"MUSE_SPARK_LINEAR_RESIDUAL": "1"},
            "no_accept_kernels": {"MUSE_SPARK_ACCEPT_KERNELS": "0"},
            "pdl_gemm_wait_only": {"MUSE_SPARK_PDL_GEMM_TRIGGER": "0"},
            "attention_one_split": {"MUSE_SPARK_ATTENTION_SPLITS": "1"}}
# the variant's --option, where its name is not the option's
VARIANT_OPTION = {"no_rope_table": "rope_table", "no_attention_cache": "attention_cache", "no_pdl": "pdl",
                  "pdl_wait_only": "pdl_trigger", "no_accept_kernels": "accept_kernels",
                  "pdl_gemm_wait_only": "pdl_gemm_trigger", "attention_one_split": "attention_splits"}


def preset_configs(name: str, layers: int | None = None, draft_layers: int | None = None):
    from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig

    p = dict(PRESETS[name])
    if layers:
        p["layers"] = layers
        p["aux"] = tuple(sorted({min(a, max(layers - 2, 0)) for a in p["aux"]}))  # the last layer is excluded
    if draft_layers:
        p["draft_layers"] = draft_layers
    common = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                  num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate_size=p["ffn"],
                  torch_dtype="bfloat16", attn_output_gate=False, output_soft_cap_temp=None, eos_token_id=[2],
                  max_position_embeddings=8192, rope_theta=500000.0)
    t = MuseSpark1xConfig.from_dict(dict(common, num_hidden_layers=p["layers"]), "bench target")
    d = MuseSparkDSparkConfig.from_dict(dict(
        common, num_hidden_layers=p["draft_layers"], draft_vocab_size=p["draft_vocab"],
        target_hidden_size=p["hidden"], target_layer_ids=list(p["aux"]), mask_token_id=3, block_size=p["gamma"],
        markov_rank=p["rank"], markov_head_type="vanilla"), "bench draft")
    d.validate_against(t)
    return t, d


def random_pair(tcfg, dcfg, device, seed: int = 0):
    """Reference modules with random weights, generated on the device (an 8B pair is 16 GB)."""
    import torch

    from muse_spark.checkpoint import expected_shapes
    from muse_spark.runtime.engine import build_modules

    g = torch.Generator(device=device).manual_seed(seed)

    def sd_for(cfg):
        sd = {}
        for name, shape in expected_shapes(cfg).items():
            if name == "draft_id_to_target_id":
                ids = torch.sort(torch.randperm(cfg.vocab_size, device=device, generator=g)[: cfg.draft_vocab_size]).values
                sd[name] = ids - torch.arange(cfg.draft_vocab_size, device=device)
            elif name.endswith("residual_gate"):
                sd[name] = 0.5 + torch.rand(shape, device=device, generator=g)
            elif name.endswith("norm.weight"):
                sd[name] = 1 + 0.1 * torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
            else:
                sd[name] = 0.02 * torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
        return sd

    return build_modules(tcfg, dcfg, sd_for(tcfg), sd_for(dcfg), torch.bfloat16, device)


# Steps the bench's chained measurement runs from one set of host inputs (positions advance by ≤ γ+1 a
# step: the bench's context of 1024 keys leaves room in its window of 1152).
CHAINED = 8

# The packages of one bucket's step (``step_{part}_b{B}``, builder.aoti.graph_plan_names).
STEP_PARTS = ("draft", "layer", "verify", "context")


# ---- timing ---------------------------------------------------------------------------------------
def time_fn(fn, device, iters: int, warmup: int = 3) -> dict:
    """Median / min milliseconds of ``fn()`` by CUDA events (wall clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def host_description(device_type: str = "cpu") -> dict:
    """Facts about the machine the run's host code ran on, to group runs by: the kernel release
    (a sandbox's own kernel reports itself here: gVisor gives 4.4.0), the CPU model, the cores this
    process may run on and the NUMA nodes; on CUDA, the driver version. The host's time to issue a
    step differed by up to 6x between machine starts of the same kind (docs/benchmarks.md)."""
    import platform

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None

    cpuinfo = read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.lower().startswith("model name")), platform.processor() or None)
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    host = {"kernel": platform.release(), "machine": platform.machine(), "cpu_model": model,
            "cpus": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "numa_nodes": {n.name: (read(str(n / "cpulist")) or "").strip() for n in nodes}}
    if device_type == "cuda":
        import subprocess

        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            host["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            host["driver"] = None
    return host


def host_issue_us(fn, device, iters: int, warmup: int = 3) -> float:
    """Median microseconds the host spends in ``fn()`` before it returns (the device's work it
    issued not awaited; synchronized between calls, so each starts on an idle device)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def profile_kernels(fn, device, calls: int = 3, top: int = 15, keep_all: bool = False) -> dict:
    """Where a call's device time goes: torch.profiler over ``calls`` calls of ``fn`` -> the kernel
    time per call and the ``top`` kernels (name, launches per call, ms per call, share);
    ``keep_all``: also ``all``, {name: ms per call} of every kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    per: dict[str, list] = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and e.cpu_children:  # CPU: leaf operators only, so nothing is counted twice
            continue
        us = e.device_time if cuda else e.cpu_time
        acc = per.setdefault(e.name, [0, 0.0])
        acc[0] += 1
        acc[1] += us
    total = sum(v[1] for v in per.values()) / calls / 1e3
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    out = {"kernel_ms": total, "calls": calls,
           "top": [{"name": k[:120], "launches": v[0] / calls, "ms": v[1] / calls / 1e3,
                    "share": v[1] / calls / 1e3 / total if total else 0.0} for k, v in rows]}
    if keep_all:
        out["all"] = {k[:120]: [v[0] / calls, v[1] / calls / 1e3] for k, v in per.items()}
    if cuda:
        out.update(device_gaps([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA], calls, top))
    return out


def device_gaps(spans: list, calls: int, top: int = 15) -> dict:
    """Where the device sits idle between kernels: ``spans`` ([name, start us, end us] of every
    device event of ``calls`` back-to-back calls) -> ``idle_ms``, the time between one event's end
    and the next one's start summed, per call (the holes between two calls are in it: a step
    replayed back to back pays them too), and ``gaps``: the ``top`` (previous event, next event)
    pairs by their idle ms per call, with how often the pair occurs per call."""
    spans = sorted(spans, key=lambda s: s[1])
    pairs: dict[tuple, list] = {}
    for (pn, _, pe), (nn, ns, _) in zip(spans, spans[1:]):
        acc = pairs.setdefault((pn[:60], nn[:60]), [0, 0.0])
        acc[0] += 1
        acc[1] += max(ns - pe, 0.0)
    idle = sum(v[1] for v in pairs.values()) / calls / 1e3
    rows = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {"idle_ms": idle, "gaps": [{"after": a, "before": b, "count": v[0] / calls, "ms": v[1] / calls / 1e3}
                                      for (a, b), v in rows]}


def slower_in_graph(plain: dict, replay: dict, top: int = 10) -> list:
    """The kernels whose time per step grew most from the packages' plain calls to the graph's
    replay (``profile_kernels(keep_all=True)`` of each): [name, launches, plain ms, replay ms]."""
    rows = [[k, launches, plain["all"].get(k, [0, 0.0])[1], ms] for k, (launches, ms) in replay["all"].items()]
    return sorted(rows, key=lambda r: r[2] - r[3])[:top]


def copy_buffers(device, gib: float = 2.0) -> tuple:
    """The roofline copy's source (``gib`` GiB of fp32) and destination."""
    import torch

    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device).normal_()
    return src, torch.empty_like(src)


def copy_bandwidth(device, gib: float = 2.0, buffers: tuple | None = None) -> dict:
    """Device-to-device copy, counting bytes read + written (METHOD.md); ``buffers``: a
    ``copy_buffers`` pair to copy (kept by a caller that times the copy again and again)."""
    src, dst = copy_buffers(device, gib) if buffers is None else buffers
    r = time_fn(lambda: dst.copy_(src), device, iters=10)
    bytes_moved = 2 * src.numel() * src.element_size()
    return {"bytes": bytes_moved, "median_ms": r["median_ms"], "GBps": bytes_moved / r["median_ms"] / 1e6}


def step_bytes(tcfg, dcfg, batch: int, context: int) -> dict:
    """The fewest bytes one speculative step reads: every weight matrix once (embedding and W1 rows
    only where gathered), valid KV once. bf16 weights/KV; fp32 residual gates ignored (tiny)."""
    g, D, e = dcfg.block_size, tcfg.hidden_size, 2
    t_layer = (tcfg.qkv_out * D + tcfg.q_size * D + 3 * tcfg.intermediate_size * D) * e
    d_layer = (dcfg.qkv_out * D + dcfg.q_size * D + 3 * dcfg.intermediate_size * D) * e
    target_w = tcfg.num_hidden_layers * t_layer + tcfg.vocab_size * D * e + batch * (g + 1) * D * e
    draft_w = (dcfg.num_hidden_layers * d_layer + dcfg.draft_vocab_size * D * e  # layers, lm_head
               + dcfg.hidden_size * dcfg.target_hidden_size * len(dcfg.target_layer_ids) * e  # fc
               + dcfg.draft_vocab_size * dcfg.markov_rank * e + batch * g * dcfg.markov_rank * e  # W2, W1 rows
               + batch * g * D * e)  # embedding rows of the block
    kv_row = 2 * tcfg.num_key_value_heads * tcfg.head_dim * e  # K and V of one position, one layer
    target_kv = tcfg.num_hidden_layers * batch * (context + g + 1) * kv_row
    draft_kv = dcfg.num_hidden_layers * batch * context * kv_row
    return {"weights": target_w + draft_w, "kv": target_kv + draft_kv,
            "total": target_w + draft_w + target_kv + draft_kv}


def step_matrices(target, draft) -> list:
    """The weight matrices a speculative step multiplies by, with the rows it multiplies:
    ``[(name, weight, "target"|"draft")]``. Every ``nn.Linear`` of both models (the target's
    lm_head is its embedding when tied) except the Markov head's, which the Markov loop reads."""
    from torch import nn

    mats = [(f"target.{n}", m.weight, "target") for n, m in target.named_modules() if isinstance(m, nn.Linear)]
    if getattr(target, "lm_head", None) is None:
        mats.append(("target.embed_tokens (tied lm_head)", target.embed_tokens.weight, "target"))
    mats += [(f"draft.{n}", m.weight, "draft") for n, m in draft.named_modules()
             if isinstance(m, nn.Linear) and "markov" not in n]
    return mats


def gemm_floor(target, draft, batch: int, gamma: int, device, iters: int, engine: bool = False) -> dict:
    """The step's weight GEMMs alone, back to back (captured in one CUDA graph on the GPU): the
    target's with B·(γ+1) rows, the draft's with B·γ. cuBLAS through ``F.linear``, or with
    ``engine`` the engine's own path (``models.layers.linear`` / ``linear_silu_mul``: the skinny
    Triton kernel with silu·mul fused for ≤ 16 rows by default; cuBLAS and a silu kernel under
    ``MUSE_SPARK_LINEAR=cublas`` or for more rows). What a step built on these GEMMs cannot beat,
    whatever it fuses around them."""
    import torch
    import torch.nn.functional as F

    from muse_spark.models.layers import linear, linear_silu_mul

    mats = step_matrices(target, draft)
    rows = {"target": batch * (gamma + 1), "draft": batch * gamma}
    xs = {}
    for _, w, who in mats:
        key = (rows[who], w.shape[1], w.dtype)
        if key not in xs:
            xs[key] = torch.randn(key[0], key[1], device=device).to(w.dtype)
    calls = [(xs[(rows[who], w.shape[1], w.dtype)], w, engine and name.endswith("gate_up_proj"))
             for name, w, who in mats]
    gemm = linear if engine else F.linear

    def run():
        for x, w, silu_mul in calls:
            linear_silu_mul(x, w) if silu_mul else gemm(x, w)

    with torch.inference_mode():
        if device.type == "cuda":
            from muse_spark.plugins.markov.bench import time_in_graph

            us, how = time_in_graph([run], reps=1, replays=iters)
            r = {"median_ms": us / 1e3, "iters": iters}
        else:
            r, how = time_fn(run, device, iters), "eager"
    wbytes = sum(w.numel() * w.element_size() for _, w, _ in mats)
    return dict(r, how=how, gemms=len(mats), weight_bytes=wbytes)


# ---- the benchmark ----------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        import torch

        self.a = args
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(args.device)
        self.result: dict = {"command": args.command, "preset": args.preset, "sections": {}}
        self.t0 = time.perf_counter()
        self.replays: dict = {}  # batch -> {label: CUDA-graph step}, for interleaved_replays

    def log(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def save(self) -> None:
        """Write the JSON and the markdown as they stand (a run cut short keeps what it measured)."""
        if self.a.json:
            Path(self.a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.a.json).write_text(json.dumps(self.result, indent=2) + "\n")
        if self.a.markdown:
            Path(self.a.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(self.a.markdown).write_text(render_markdown(self.result))

    def run(self) -> dict:
        import torch

        from muse_spark.builder.aoti import (compile_job, graph_jobs, inductor_configs, int64_indexing,
                                             markov_workspaces, resolve_plugin_impl)
        from muse_spark.runtime.aoti_graphs import SpecPair, weight_specs
        from muse_spark.runtime.engine import EagerEngine

        a, dev = self.a, self.device
        batches = sorted(a.batches)
        tcfg, dcfg = preset_configs(a.preset, a.layers, a.draft_layers)
        g = dcfg.block_size
        max_seq = a.max_seq or (a.context + 128)
        slots = max(batches) + 1  # + the scratch slot the aoti engine pads with
        self.result.update(env=self.environment(), config=dict(
            target=tcfg.to_dict(), draft=dcfg.to_dict(), gamma=g, context=a.context, max_seq=max_seq,
            batches=batches, iters=a.iters, aoti_order="ascending" if a.aoti_ascending else "descending"))
        impl = resolve_plugin_impl(a.plugins, str(dev)) if "aoti" not in a.skip else "inline"
        self.result["config"]["plugin_impl"] = impl

        self.log(f"random {a.preset} pair on {dev}")
        target, draft = random_pair(tcfg, dcfg, dev)
        from muse_spark.models.layers import attention_path, linear_path

        self.result["config"]["attention"] = attention_path(dev, target.dtype)  # MUSE_SPARK_ATTENTION
        self.result["config"]["linear"] = linear_path(dev, target.dtype)  # MUSE_SPARK_LINEAR
        eng = EagerEngine(target, draft, max_batch=slots, max_seq=max_seq, device=dev)
        fill = torch.Generator(device=dev).manual_seed(1)  # seeded: every run checks the same step
        for t in eng.target_cache.k + eng.target_cache.v + eng.draft_cache.k + eng.draft_cache.v:
            t.normal_(generator=fill)
        caches = (eng.target_cache.k, eng.target_cache.v, eng.draft_cache.k, eng.draft_cache.v)
        wspecs = weight_specs(SpecPair(target, draft))

        def inputs(b):
            gen = torch.Generator(device=dev).manual_seed(b)
            return (torch.randint(0, tcfg.vocab_size, (b,), device=dev, generator=gen),
                    torch.full((b,), a.context, device=dev, dtype=torch.int64),
                    torch.arange(b, device=dev), torch.arange(b, device=dev) + 1000,
                    torch.full((b,), 1.0, device=dev))

        kv_len = a.context + g + 1
        sec = self.result["sections"]

        # ---- memory bandwidth and roofline -----------------------------------------------------
        bw = copy_bandwidth(dev, gib=2.0 if dev.type == "cuda" else 0.25)
        sec["copy_bandwidth"] = bw
        sec["bytes_per_step"] = {b: step_bytes(tcfg, dcfg, b, a.context) for b in batches}
        sec["roofline_ms"] = {b: sec["bytes_per_step"][b]["total"] / bw["GBps"] / 1e6 for b in batches}
        self.log(f"copy bandwidth {bw['GBps']:.0f} GB/s; roofline "
                 + ", ".join(f"B={b}: {sec['roofline_ms'][b]:.2f} ms" for b in batches))
        self.save()

        # ---- the GEMM floor: the step's weight GEMMs alone, back to back -------------------------
        # The engine's own GEMM sequence only where it is not cuBLAS's (the skinny kernel, batch ≤ 2):
        # on cuBLAS it would add an unfused eager silu·mul that the compiled step fuses into one kernel.
        from muse_spark.models.layers import linear_path

        floors = [("gemm_floor", False, batches)]
        if linear_path(dev, target.dtype) == "triton":
            # Only batches whose every GEMM fits the skinny kernel (≤ MAX_ROWS rows): above, the
            # engine's GEMMs are cuBLAS's plus an eager silu·mul the compiled step does not have.
            from muse_spark.plugins.linear.triton_kernel import MAX_ROWS

            fit = [b for b in batches if b * (g + 1) <= MAX_ROWS]
            if fit:
                floors.append(("gemm_floor_engine", True, fit))
        for name, engine, bs in floors:
            sec[name] = {}
            for b in bs:
                r = sec[name][b] = gemm_floor(target, draft, b, g, dev, a.iters, engine=engine)
                self.log(f"GEMM floor B={b} ({'the engine GEMMs' if engine else 'cuBLAS'}): {r['median_ms']:.2f} ms "
                         f"({r['gemms']} GEMMs, {r['how']}; {r['median_ms'] / sec['roofline_ms'][b]:.2f}× the roofline)")
        self.save()

        # ---- (a) eager ---------------------------------------------------------------------------
        if "eager" not in a.skip:
            sec["eager"] = {}
            with torch.inference_mode():
                for b in batches:
                    x = inputs(b)
                    sec["eager"][b] = time_fn(lambda: eng.step(*x, kv_len), dev, a.iters)
                    self.log(f"eager B={b}: {sec['eager'][b]['median_ms']:.2f} ms")
            self.save()

        # ---- start the aoti compiles (worker processes) -----------------------------------------
        pool = futures = None
        vfutures: dict = {}
        compiled_files: dict = {}
        if "aoti" not in a.skip:
            out_dir = Path(a.work_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            self.markov_words = markov_workspaces(impl, str(dev), eng.draft, tcfg.vocab_size, batches)
            jobs = graph_jobs(tcfg, dcfg, wspecs, device=str(dev), max_seq=max_seq, cache_slots=slots,
                              buckets=batches, prefill_chunk=1, impl=impl, cache_dtype="bfloat16",
                              configs=inductor_configs(str(dev), fast_compile=dev.type == "cpu"),
                              out_dir=out_dir, with_prefill=False, markov_words=self.markov_words)
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Variants: the same packages compiled with a kernel switch set in the worker (VARIANTS).
            vjobs = {name: [dict(j, env=env, out=str(out_dir / name / Path(j["out"]).name)) for j in jobs]
                     for name, env in VARIANTS.items() if getattr(a, VARIANT_OPTION.get(name, name)) == "both"}
            for name in vjobs:
                (out_dir / name).mkdir(parents=True, exist_ok=True)
            n_jobs = len(jobs) + sum(map(len, vjobs.values()))
            pool = ProcessPoolExecutor(max_workers=n_jobs, mp_context=multiprocessing.get_context("spawn"))
            threads = max(1, (os.cpu_count() or 1) // (n_jobs + 1))
            futures = [pool.submit(compile_job, dict(j, compile_threads=threads)) for j in jobs]
            vfutures = {name: [pool.submit(compile_job, dict(j, compile_threads=threads)) for j in js]
                        for name, js in vjobs.items()}
            self.log(f"aoti: compiling {len(jobs)} step packages (draft, one target layer, finish per batch; "
                     f"{impl} plugins) in worker processes")

        # ---- (b) torch.compile of the eager step -------------------------------------------------
        from muse_spark.plugins.dispatch import plugin_impl

        compiled, compiled_inputs = None, {}
        numerics = inductor_configs(str(dev), fast_compile=False)
        if "compile" not in a.skip:
            sec["torch_compile"] = {"mode": a.compile_mode, "static_per_batch": a.compile_static,
                                         "plugins": impl, "inductor_configs": numerics}
            for t in [t for c in caches for t in c]:
                torch._dynamo.mark_static_address(t)  # gpt-fast: the KV cache is a static buffer
            raw_step = EagerEngine.step.__wrapped__  # the body, without the inference_mode decorator

            def eager_step(*xs):
                return raw_step(eng, *xs, kv_len)

            compiled = torch.compile(eager_step, mode=a.compile_mode, dynamic=False if a.compile_static else None)

        def compile_for(bs) -> bool:
            """Compile (and record the CUDA graphs of) the torch.compile step for ``bs``."""
            tc = sec["torch_compile"]
            try:
                # The same Inductor options as the aoti build (eager-precision casts), same index fix.
                with torch.inference_mode(), plugin_impl(impl), int64_indexing(), \
                        torch._inductor.config.patch(numerics):
                    for b in bs:
                        t1 = time.perf_counter()
                        compiled_inputs[b] = inputs(b)
                        for _ in range(3):  # compile, then CUDA-graph warm-up and recording
                            compiled(*compiled_inputs[b])
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        tc.setdefault("compile_s", {})[b] = round(time.perf_counter() - t1, 1)
                        self.log(f"torch.compile B={b}: compiled in {time.perf_counter() - t1:.0f}s")
                return True
            except Exception as e:  # report what failed, keep measuring the rest
                tc["error"] = f"{type(e).__name__}: {e}"[:3000]
                self.log(f"torch.compile failed: {tc['error'][:500]}")
                return False

        def time_compiled(bs) -> None:
            with torch.inference_mode(), plugin_impl(impl):
                for b in bs:
                    x = compiled_inputs[b]
                    sec["torch_compile"][b] = time_fn(lambda: compiled(*x), dev, a.iters)
                    self.log(f"torch.compile B={b}: {sec['torch_compile'][b]['median_ms']:.2f} ms")
            self.save()

        # Batch 1 first (the comparison that matters most), while the aoti graphs compile.
        if compiled is not None and not compile_for(batches[:1]):
            compiled = None
        self.save()

        # ---- (c) aoti + CUDA graphs --------------------------------------------------------------
        if futures:
            for f in futures:
                try:
                    r = f.result()
                    compiled_files[r["name"]] = r
                except Exception as e:
                    sec.setdefault("aoti_errors", []).append(f"{type(e).__name__}: {e}"[:3000])
                    self.log(f"aoti compile failed: {str(e)[:1000]}")
            failed = [j for j in jobs if j["name"] not in compiled_files]
            aoti_impl = impl
            if failed and impl == "triton" and a.plugins == "auto":
                # As `build --plugins auto` does: the reference plugins instead, said and recorded.
                self.log(f"aoti: {len(failed)} packages failed with the Triton plugin kernels; recompiling "
                         f"all {len(jobs)} step packages with the reference plugins (inline)")
                sec["aoti_plugin_fallback"] = sorted(j["name"] for j in failed)
                aoti_impl = "inline"
                retry = [pool.submit(compile_job, dict(j, impl="inline", compile_threads=threads)) for j in jobs]
                compiled_files.clear()
                for f in retry:
                    try:
                        r = f.result()
                        compiled_files[r["name"]] = r
                    except Exception as e:
                        sec["aoti_errors"].append(f"inline: {type(e).__name__}: {e}"[:3000])
                        self.log(f"aoti compile failed again: {str(e)[:1000]}")
            sec["aoti_plugins"] = aoti_impl
            for name, fs in vfutures.items():
                sub = sec.setdefault("variants", {}).setdefault(name, {"env": VARIANTS[name], "compiled": []})
                for f in fs:
                    try:
                        sub["compiled"].append(f.result()["name"])
                    except Exception as e:
                        sub.setdefault("aoti_errors", []).append(f"{type(e).__name__}: {e}"[:3000])
                        self.log(f"aoti {name}: compile failed: {str(e)[:1000]}")
            pool.shutdown()
            sec["aoti_compile_s"] = {k: v["export_s"] + v["compile_s"] for k, v in compiled_files.items()}
            self.log(f"aoti: compiled {sorted(compiled_files)}")
        aoti_batches = [b for b in batches if all(f"step_{p}_b{b}" in compiled_files for p in STEP_PARTS)]
        if aoti_batches:
            try:
                self.aoti_section(eng, caches, aoti_batches, inputs, kv_len, scratch=slots - 1)
            except Exception as e:
                sec["aoti_error"] = f"{type(e).__name__}: {e}"[:3000]
                self.log(f"aoti section failed: {sec['aoti_error'][:500]}")
        for name, sub in sec.get("variants", {}).items():  # the same measurements, side by side
            done = [b for b in batches if all(f"step_{p}_b{b}" in sub["compiled"] for p in STEP_PARTS)]
            if done and aoti_batches:
                try:
                    self.aoti_section(eng, caches, done, inputs, kv_len, scratch=slots - 1, sec=sub,
                                      work_dir=Path(a.work_dir) / name, env=VARIANTS[name], label=f"aoti {name}")
                except Exception as e:
                    sub["aoti_error"] = f"{type(e).__name__}: {e}"[:3000]
                    self.log(f"aoti {name} section failed: {sub['aoti_error'][:500]}")

        self.interleaved_replays(sec)

        # ---- the Markov loop alone (seconds; before the long torch.compile recompiles) ------------
        try:
            self.markov_section(draft, batches, impl)
        except Exception as e:
            sec["markov_error"] = f"{type(e).__name__}: {e}"[:3000]
            self.log(f"markov section failed: {sec['markov_error'][:500]}")
        self.save()

        if compiled is not None:  # timed with the compile workers done
            time_compiled(batches[:1])
            rest = batches[1:]
            while rest:  # one batch at a time, each saved, while the deadline allows its recompile
                elapsed = time.perf_counter() - self.t0
                # Budget a full recompile: shape guards (the Markov kernel's tile depends on the
                # batch) can force one even after the dynamic-batch graph exists.
                need = 1.5 * max(sec["torch_compile"]["compile_s"].values()) + 30
                if a.deadline_s and elapsed + need > a.deadline_s:
                    sec["torch_compile"]["skipped"] = (f"batches {rest}: a recompile (~{need:.0f}s) would pass "
                                                       f"--deadline-s {a.deadline_s:.0f} at {elapsed:.0f}s")
                    self.log(f"torch.compile: {sec['torch_compile']['skipped']}")
                    break
                if not compile_for(rest[:1]):
                    break
                time_compiled(rest[:1])
                rest = rest[1:]

        # ---- tokens/s ----------------------------------------------------------------------------
        tps = {}
        for name in ("eager", "torch_compile", "aoti"):
            if name in sec:
                tps[name] = {b: {str(tau): b * tau / (sec[name][b]["median_ms"] / 1e3) for tau in TAUS}
                             for b in batches if b in sec[name]}
        sec["tokens_per_s"] = tps
        self.result["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.save()
        print(render_table(self.result))
        return self.result

    def aoti_section(self, eng, caches, batches, inputs, kv_len, scratch: int, sec: dict | None = None,
                     work_dir=None, env: dict | None = None, label: str = "aoti") -> None:
        """The aoti step of each batch: checked against the eager step, timed (runner, replay, the
        serving forms), profiled. ``sec``/``work_dir``/``env``: a variant's results dict, its
        packages, and the switches it was compiled with (set around the eager step it is checked
        against, so both take the same kernel path)."""
        import torch

        from muse_spark.builder.aoti import job_environment

        from muse_spark.runtime.aoti_engine import load_step
        from muse_spark.runtime.aoti_graphs import MARKOV_ERROR_WORD, SpecPair, weight_names, weight_tensors
        from muse_spark.models.layers import PDL_KERNELS, pdl_active
        from muse_spark.runtime.cuda_graph import CUDAGraphStep, StaticStep

        a, dev = self.a, self.device
        with job_environment(env or {}):  # the step graphs' PDL edges as the engine makes them (its manifest)
            pdl = pdl_active()
        programmatic = PDL_KERNELS if pdl and dev.type == "cuda" else ()
        sec = self.result["sections"] if sec is None else sec
        pair = SpecPair(eng.target, eng.draft)
        weights = weight_tensors(pair, weight_names(pair))
        cuda = dev.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        sec["aoti"], sec["aoti_graph_replay"], sec["aoti_matches_eager"], sec["aoti_emits_as_eager"] = {}, {}, {}, {}
        with torch.inference_mode():
            for b in sorted(batches, reverse=not a.aoti_ascending):
                fn = load_step(work_dir or a.work_dir, None, b, eng.target, eng.draft, dev, single_threaded=cuda)
                words = self.markov_words[b]  # the Markov kernel's kept workspace, as the engine keeps it
                runner = (CUDAGraphStep(fn, b, weights, caches, scratch, dev, pool=pool, markov_words=words,
                                        programmatic=programmatic) if cuda
                          else StaticStep(fn, b, weights, caches, scratch, dev, markov_words=words))
                x = inputs(b)
                # Same inputs, greedy rows: the compiled step's drafts and verdicts equal the eager step's.
                xg = x[:4] + (torch.zeros_like(x[4]),)
                with job_environment(env or {}):
                    got, want = runner(*xg), eng.step(*xg, kv_len)
                same = torch.equal(got, want)
                sec["aoti_matches_eager"][b] = same
                sec["aoti_emits_as_eager"][b] = emitted_tokens(got) == emitted_tokens(want)
                if not same:  # how far apart: rows and step-output entries that differ, and where
                    sec.setdefault("aoti_eager_differences", {})[b] = {
                        "rows": int((got != want).any(-1).sum()), "entries": int((got != want).sum()),
                        "of_rows": got.shape[0], "of_entries": got.numel(),
                        "first_columns": first_differing_columns(got, want)}
                sec["aoti"][b] = time_fn(lambda: runner(*x), dev, a.iters)
                if cuda:

                    def fill_then_replay(sync: bool, replay: bool = True, r=runner) -> None:
                        """A runner's input copies, then its graph's launch (``sync``: once the copies are
                        done; ``replay=False``: no launch)."""
                        r._fill(*x)
                        if sync:
                            torch.cuda.current_stream(dev).synchronize()
                        if replay:
                            r.graph.replay()

                    sec["aoti_graph_replay"][b] = time_fn(runner.graph.replay, dev, a.iters)
                    self.replays.setdefault(b, {})[label] = runner  # kept for interleaved_replays
                    # What the host spends issuing a step (the runner's input copies, pointer check,
                    # graph launch, output clone) and the replay alone: the runner's step costs
                    # more than the replay by up to these, where the GPU waits for the host.
                    sec.setdefault("aoti_host_issue_us", {})[b] = {
                        "step": host_issue_us(lambda: runner(*x), dev, a.iters),
                        "replay": host_issue_us(runner.graph.replay, dev, a.iters),
                        # the step's parts: the input copies, and the pointer check (after the launch)
                        "fill": host_issue_us(lambda: runner._fill(*x), dev, a.iters),
                        "check": host_issue_us(lambda: runner._assert_unmoved(False), dev, a.iters),
                        # the launch right after the copies, and after waiting for them: the twenty-second
                        # session's step took 228-231 µs to issue against 60-70 for its parts alone
                        "fill_replay": host_issue_us(lambda: fill_then_replay(False), dev, a.iters),
                        "fill_sync_replay": host_issue_us(lambda: fill_then_replay(True), dev, a.iters),
                        # ... and the copies with that wait alone: fill_sync_replay less this is what the
                        # launch costs after the copies (the twenty-third session: 261 µs against the
                        # launch's 50 alone on one machine start, 40 against 6 on another)
                        "fill_sync": host_issue_us(lambda: fill_then_replay(True, replay=False), dev, a.iters)}
                    # ... and what the device sees of them (CUDA events: the idle before the graph counts)
                    sec.setdefault("aoti_fill_replay", {})[b] = {
                        "then": time_fn(lambda: fill_then_replay(False), dev, a.iters),
                        "after_sync": time_fn(lambda: fill_then_replay(True), dev, a.iters)}
                if programmatic:  # the same packages: the edges' other port, and plain edges (the waits' cost)
                    sec.setdefault("aoti_pdl", {})[b] = self.pdl_replays(runner, fn, b, weights, caches, scratch,
                                                                         words, pool, x, label)
                if cuda and fn.side is not None:  # the same packages, the draft context in line (one stream)
                    serial = copy.copy(fn)
                    serial.side = None
                    other = CUDAGraphStep(serial, b, weights, caches, scratch, dev, pool=pool, markov_words=words,
                                          programmatic=programmatic)
                    sec.setdefault("aoti_context_stream", {})[b] = {
                        "equals": bool(torch.equal(other(*xg), runner(*xg))),
                        "serial_replay": time_fn(other.graph.replay, dev, a.iters),
                        "side_replay": time_fn(runner.graph.replay, dev, a.iters),
                        # the host's time to launch each after the input copies (the forked graph's: its
                        # fill_replay above): whether the launch-after-copies cost (185 µs on a slow machine
                        # start) comes with the forked graph
                        "host_issue_us": {
                            "serial_fill_replay": host_issue_us(lambda: fill_then_replay(False, r=other), dev,
                                                                a.iters),
                            "side_fill_replay": sec["aoti_host_issue_us"][b]["fill_replay"]}}
                    self.replays[b][f"{label} serial_context"] = other
                    cs = sec["aoti_context_stream"][b]
                    self.log(f"{label} B={b}: draft context on a second stream {cs['side_replay']['median_ms']:.3f} ms, "
                             f"in line {cs['serial_replay']['median_ms']:.3f} ms (same step: {cs['equals']})")
                # The serving loop's form, host values in and rows out: as the generator did it before
                # (tensors built on the device from lists, the step, .cpu()) and through step_host.
                host = [t.tolist() for t in x]

                def from_lists():
                    ts = [torch.tensor(v, device=dev, dtype=t.dtype) for v, t in zip(host, x)]
                    return runner(*ts).cpu().tolist()

                sec.setdefault("aoti_serving_lists", {})[b] = time_fn(from_lists, dev, a.iters)
                # The Generator's form on an aoti engine: each step's successor launched (inputs advanced
                # on the device) before its rows are read, so the host's work between steps is off the
                # device's path: CHAINED steps from the same host inputs, timed together, per step.
                room = caches[0][0].shape[1] - 1 - eng.gamma - max(host[1])  # the positions left in the window
                steps = max(1, min(CHAINED, room // (eng.gamma + 1) + 1))

                def chained():
                    h = runner.launch_host(*host)
                    for _ in range(steps - 1):
                        nxt = runner.launch_next(h)
                        runner.rows(h)
                        h = nxt
                    return runner.rows(h)

                t = time_fn(chained, dev, max(3, a.iters // steps))
                sec.setdefault("aoti_chained", {})[b] = {"steps": steps, "median_ms": t["median_ms"] / steps,
                                                         "min_ms": t["min_ms"] / steps}
                sec.setdefault("aoti_step_host", {})[b] = time_fn(lambda: runner.step_host(*host), dev, a.iters)
                sec.setdefault("aoti_step_host_equals_step", {})[b] = runner.step_host(*host) == runner(*x).tolist()
                if cuda:  # step_host as one launch (its copies captured with the step), in turns with the plain form
                    sec.setdefault("aoti_step_host_graph", {})[b] = self.host_graph_rounds(
                        runner, fn, b, weights, caches, scratch, words, pool, programmatic, host)
                if runner.markov_ws.numel():  # after every timed step: no Markov program gave up waiting
                    sec.setdefault("aoti_markov_error_flag", {})[b] = int(runner.markov_ws[MARKOV_ERROR_WORD])
                issue = sec.get("aoti_host_issue_us", {}).get(b)
                self.log(f"{label} B={b}: {sec['aoti'][b]['median_ms']:.2f} ms (greedy step equals eager: {same}); "
                         f"serving form: lists → device tensors → step → .cpu() "
                         f"{sec['aoti_serving_lists'][b]['median_ms']:.2f} ms, step_host "
                         f"{sec['aoti_step_host'][b]['median_ms']:.2f} ms, chained steps (the Generator's form) "
                         f"{sec['aoti_chained'][b]['median_ms']:.2f} ms a step"
                         + (f"; host time to issue: step {issue['step']:.0f} µs, replay {issue['replay']:.0f} µs"
                            if issue else ""))
                if a.profile:  # the same packages, called without the graph: the kernels it replays
                    plain = StaticStep(fn, b, weights, caches, scratch, dev, markov_words=words)
                    prof = profile_kernels(lambda: plain(*x), dev, keep_all=cuda)
                    self.log(f"{label} B={b} profile: {prof['kernel_ms']:.2f} ms of kernels per step; top: "
                             + "; ".join(f"{r['name'][:60]} {r['ms']:.3f} ms" for r in prof["top"][:5]))
                    if cuda:  # the graph's replay too: which kernels run longer inside it
                        rep = profile_kernels(runner.graph.replay, dev, keep_all=True)
                        slower = slower_in_graph(prof, rep)
                        sec.setdefault("aoti_replay_profile", {})[b] = dict(
                            kernel_ms=rep["kernel_ms"], top=rep["top"], slower_in_graph=slower, all=rep["all"],
                            idle_ms=rep["idle_ms"], gaps=rep["gaps"])
                        self.log(f"{label} B={b} replay profile: {rep['kernel_ms']:.2f} ms of kernels per replay; "
                                 "most slower in the graph: " + "; ".join(
                                     f"{n[:50]} x{k:g} {p:.3f}->{r:.3f} ms" for n, k, p, r in slower[:6]))
                        self.log(f"{label} B={b} replay idle: {rep['idle_ms']:.3f} ms per replay between kernels; "
                                 "largest: " + "; ".join(f"{g['after'][:40]} -> {g['before'][:40]} x{g['count']:g} "
                                                         f"{g['ms']:.3f} ms" for g in rep["gaps"][:5]))
                        # the runner's whole step (input copies, replay, output clone): what it adds
                        call = profile_kernels(lambda: runner(*x), dev, keep_all=True)
                        in_replay = {k: rep["all"].get(k, [0, 0.0]) for k in call["all"]}
                        sec.setdefault("aoti_runner_profile", {})[b] = dict(
                            kernel_ms=call["kernel_ms"], idle_ms=call["idle_ms"], gaps=call["gaps"],
                            calls=call["calls"],
                            beyond_replay={k: [n - in_replay[k][0], ms - in_replay[k][1]]
                                           for k, (n, ms) in call["all"].items() if n > in_replay[k][0]})
                        self.log(f"{label} B={b} runner step: {call['kernel_ms']:.2f} ms of device events, "
                                 f"{call['idle_ms']:.3f} ms idle; events beyond the replay's: "
                                 + "; ".join(f"{k[:40]} x{n:g} {ms * 1e3:.1f} µs" for k, (n, ms) in
                                             sec["aoti_runner_profile"][b]["beyond_replay"].items()))
                    sec.setdefault("aoti_profile", {})[b] = prof  # with every kernel ("all") on CUDA: a
                    # kernel below the top's cutoff must not look absent when two runs are compared
        self.save()

    def interleaved_replays(self, sec: dict, rounds: int = 7, copy_gib: float = 2.0) -> None:
        """The default step graph and each variant's, timed in turns (``rounds`` rounds of
        ``--iters`` replays each), with the device-to-device copy the roofline divides by timed in
        the same rounds: a difference of a percent between two sections timed minutes apart can be
        the GPU's clocks (the first section after the compile ran up to 5 % faster than the same graph
        a few seconds later on the H200, fifteenth session); one taken in turns cannot.
        -> ``aoti_interleaved_replay`` {batch: {label: median of the rounds' medians, ms}} and
        ``in_turns`` {batch: copy GB/s, its roofline and the default graph's ratio to it}; the graphs
        are released after."""
        replays, self.replays = self.replays, {}
        if not replays:
            return
        buffers = copy_buffers(self.device, copy_gib)  # the roofline's copy (copy_bandwidth), kept for the rounds
        for b, runners in sorted(replays.items()):
            rounds_ms: dict[str, list] = {label: [] for label in runners}
            copy_gbps: list = []
            for _ in range(rounds):
                for label, runner in runners.items():
                    rounds_ms[label].append(time_fn(runner.graph.replay, self.device, self.a.iters)["median_ms"])
                copy_gbps.append(copy_bandwidth(self.device, buffers=buffers)["GBps"])
            got = {label: statistics.median(v) for label, v in rounds_ms.items()}
            sec.setdefault("aoti_interleaved_replay", {})[b] = got
            gbps = statistics.median(copy_gbps)
            turns = {"copy_GBps": gbps}
            total = sec.get("bytes_per_step", {}).get(b, {}).get("total")
            if total:
                turns["roofline_ms"] = total / gbps / 1e6
                if "aoti" in got:
                    turns["aoti_replay_over_roofline"] = got["aoti"] / turns["roofline_ms"]
            sec.setdefault("in_turns", {})[b] = turns
            base = got.get("aoti")
            self.log(f"B={b} step graphs replayed in turns ({rounds} rounds): " + ", ".join(
                f"{label} {ms:.3f} ms" + (f" ({ms / base:.3f}×)" if base and label != "aoti" else "")
                for label, ms in got.items()) + f"; copy in the same rounds {gbps:.0f} GB/s"
                + (f", roofline {turns['roofline_ms']:.2f} ms: the default graph {turns['aoti_replay_over_roofline']:.3f}×"
                   if "aoti_replay_over_roofline" in turns else ""))

    def pdl_replays(self, runner, fn, b, weights, caches, scratch, words, pool, x, label) -> dict:
        """A PDL variant's step graph (``runner``, edges rewritten through the programmatic port)
        beside the same packages captured with the launch-order port and with plain edges: each
        graph's replay time, rewritten edges, and whether its step equals ``runner``'s."""
        import torch

        from muse_spark.models.layers import PDL_KERNELS
        from muse_spark.runtime.cuda_graph import CUDAGraphStep

        a, dev = self.a, self.device
        want = runner(*x)
        res = {"programmatic": {"edges": runner.programmatic_edges, "kernels": runner.graph_kernels,
                                "replay": time_fn(runner.graph.replay, dev, a.iters)}}
        for name, kw in (("launch_order", dict(programmatic=PDL_KERNELS, pdl_port="launch_order")),
                         ("plain_edges", dict(programmatic=()))):
            other = CUDAGraphStep(fn, b, weights, caches, scratch, dev, pool=pool, markov_words=words, **kw)
            res[name] = {"edges": other.programmatic_edges, "equals": bool(torch.equal(other(*x), want)),
                         "replay": time_fn(other.graph.replay, dev, a.iters)}
        self.log(f"{label} B={b}: {res['programmatic']['edges']} of the graph's edges into its "
                 f"{res['programmatic']['kernels']} kernels programmatic; replay " + ", ".join(
                     f"{k} {v['replay']['median_ms']:.3f} ms" for k, v in res.items()))
        return res

    def markov_section(self, draft, batches, impl) -> None:
        """The Markov loop alone: the reference (eager ops; it cannot be graph-captured, its
        scalar constants are host→device copies) and the Triton op when it imports (graph replay)."""
        import torch

        from muse_spark.plugins import dispatch
        from muse_spark.plugins.dispatch import plugin_impl
        from muse_spark.runtime.aoti_graphs import MARKOV_ERROR_WORD

        a, dev, sec = self.a, self.device, self.result["sections"]
        c = draft.cfg
        mh = draft.model.markov_head
        sec["markov"] = {}
        impls = ["op"]
        if dev.type == "cuda":
            try:
                import muse_spark.plugins.triton_ops  # noqa: F401

                impls.append("triton")
            except Exception as e:
                sec["markov_triton_unavailable"] = f"{type(e).__name__}: {e}"[:500]
        for b in batches:
            gen = torch.Generator(device=dev).manual_seed(7)
            U = torch.randn(b, c.block_size, c.draft_vocab_size, device=dev, generator=gen)
            h = torch.randn(b, c.block_size, c.hidden_size, device=dev, generator=gen).to(draft.dtype)
            anchor = torch.randint(0, c.vocab_size, (b,), device=dev, generator=gen)
            pos = torch.full((b,), a.context, device=dev)
            seeds = torch.arange(b, device=dev)
            temp = torch.ones(b, device=dev)
            args = (U, h, anchor, mh.markov_w1.weight, mh.markov_w2.weight, draft.d2t, seeds, pos, temp,
                    mh.head_type, None, None, 0)
            row = {}
            # The Triton op twice: with the workspace the engines keep per bucket (zeroed once), as
            # the step graphs call it, and with none (the op zeroes one per call).
            runs = [("op", "reference (eager ops)", False)]
            if "triton" in impls:
                runs += [("triton", "triton, kept workspace (in a CUDA graph; as the engines call it)", True),
                         ("triton", "triton, workspace zeroed per call (in a CUDA graph)", False)]
            for name, label, kept in runs:
                try:
                    with plugin_impl(name), torch.inference_mode():
                        ws = None
                        if kept:
                            from muse_spark.plugins.triton_ops import markov_workspace_words

                            ws = torch.zeros(markov_workspace_words(b, c.block_size, c.draft_vocab_size, c.vocab_size,
                                                                    c.markov_rank, mh.head_type, dev,
                                                                    mh.markov_w1.weight.dtype),
                                             dtype=torch.int64, device=dev)
                        fn = lambda: dispatch.markov_sample(*args, workspace=ws)  # noqa: E731
                        if name == "triton":
                            # As in the step's graph: 16 calls captured back to back, so the
                            # graph's own launch is amortized (plugins/markov/bench.py's method).
                            from muse_spark.plugins.markov.bench import time_in_graph

                            us, how = time_in_graph([fn], reps=16)
                            row[label] = {"median_ms": us / 1e3, "how": how, "calls_per_replay": 16}
                            if kept:  # the kernel's error flag: no program gave up waiting for the others
                                row[label]["error_flag"] = int(ws[MARKOV_ERROR_WORD])
                        else:
                            row[label] = time_fn(fn, dev, a.iters)
                except Exception as e:
                    row[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
            sec["markov"][b] = row
            self.log(f"markov B={b}: " + ", ".join(f"{k} {v.get('median_ms', float('nan')):.3f} ms"
                                                    for k, v in row.items()))
        self.save()

    def host_graph_rounds(self, runner, fn, b, weights, caches, scratch, words, pool, programmatic, host,
                          rounds: int = 3) -> dict:
        """``step_host`` through a runner with the host graph (the copy in, the step and the copy out in one
        launch) against ``runner``'s plain form, timed in turns: → their medians of the rounds' medians,
        whether their rows are equal, or the error that stopped it."""
        from muse_spark.runtime.cuda_graph import CUDAGraphStep, StaticStep

        def plain() -> list[list[int]]:  # (StaticStep's form: the plain graph, whatever MUSE_SPARK_HOST_GRAPH says)
            return StaticStep.step_host(runner, *host)

        try:
            one = CUDAGraphStep(fn, b, weights, caches, scratch, self.device, pool=pool, markov_words=words,
                                programmatic=programmatic, host_graph=True)
            equals = one.step_host(*host) == plain()
            got: dict[str, list[float]] = {"one_launch": [], "plain": []}
            for _ in range(rounds):
                for name, call in (("one_launch", lambda: one.step_host(*host)), ("plain", plain)):
                    got[name].append(time_fn(call, self.device, self.a.iters)["median_ms"])
        except Exception as e:  # (a run's other sections still count)
            return {"error": f"{type(e).__name__}: {e}"[:500]}
        res = {"equals": equals, **{k: statistics.median(v) for k, v in got.items()}}
        self.log(f"step_host B={b} as one launch {res['one_launch']:.3f} ms, plain {res['plain']:.3f} ms "
                 f"({res['one_launch'] / res['plain']:.3f}×, in turns; rows equal: {equals})")
        return res

    def environment(self) -> dict:
        import torch

        env = {"torch": torch.__version__, "device": str(self.device), "host": host_description(self.device.type)}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            env.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                       memory_gib=round(p.total_memory / 2**30, 1))
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
        return env


# ---- reporting --------------------------------------------------------------------------------------
def emitted_tokens(packed) -> list:
    """The tokens a packed step output ([B, γ+2]: γ drafts, n accepted, bonus) emits per row:
    the accepted drafts, then the bonus. Drafts past the accepted ones are never emitted, so two
    steps whose drafts differ only there emit the same tokens."""
    gamma = packed.shape[-1] - 2
    return [row[:row[gamma]] + [row[gamma + 1]] for row in packed.tolist()]


def first_differing_columns(got, want) -> dict:
    """Per differing row of two packed step outputs ([B, γ+2]: γ draft tokens, n accepted, the
    bonus), the first column that differs, counted by name: a draft token means the draft
    already differed; ``accepted``/``bonus`` mean the same drafts got another verdict."""
    gamma = got.shape[-1] - 2
    names = [f"draft[{i}]" for i in range(gamma)] + ["accepted", "bonus"]
    out: dict[str, int] = {}
    for row in (got != want).tolist():
        if any(row):
            name = names[row.index(True)]
            out[name] = out.get(name, 0) + 1
    return out


def _ms(sec: dict, name: str, b) -> float | None:
    v = sec.get(name, {}).get(b) or sec.get(name, {}).get(str(b))
    return v["median_ms"] if isinstance(v, dict) and "median_ms" in v else None


def render_table(result: dict) -> str:
    sec = result["sections"]
    batches = result["config"]["batches"]
    roof = {int(k): v for k, v in sec.get("roofline_ms", {}).items()}
    lines = ["| batch | roofline ms | GEMM floor ms: cuBLAS | engine GEMMs | eager ms | torch.compile ms "
             "| aoti + CUDA graph ms | aoti / roofline | aoti / GEMM floor | eager / aoti | compile / aoti |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(x, y):
        return f(x / y if x and y else None, "{:.2f}×")

    for b in batches:
        e, c, o = _ms(sec, "eager", b), _ms(sec, "torch_compile", b), _ms(sec, "aoti", b)
        r, gf, ge = roof.get(b), _ms(sec, "gemm_floor", b), _ms(sec, "gemm_floor_engine", b)
        lines.append(f"| {b} | {f(r)} | {f(gf)} | {f(ge)} | {f(e)} | {f(c)} | {f(o)} | {ratio(o, r)} | {ratio(o, ge or gf)} "
                     f"| {ratio(e, o)} | {ratio(c, o)} |")
    return "\n".join(lines)


def render_markdown(result: dict) -> str:
    sec, cfg, env = result["sections"], result["config"], result["env"]
    t, d = cfg["target"], cfg["draft"]
    tc = sec.get("torch_compile", {})
    bw = sec.get("copy_bandwidth", {})
    out = [
        "# Benchmarks",
        "",
        "Written by `muse-spark bench` (muse_spark/bench.py); the numbers below are from one run.",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"* Device: {env.get('gpu', env['device'])} (compute capability {env.get('compute_capability', '—')}), "
        f"torch {env['torch']}, Triton {env.get('triton')}.",
        *([f"* Host: kernel {h.get('kernel')}, {h.get('cpu_model')}, {h.get('cpus_allowed')} of {h.get('cpus')} "
           f"CPUs allowed, NUMA nodes {', '.join(f'{k} [{v}]' for k, v in h.get('numa_nodes', {}).items()) or '—'}"
           + (f", driver {h.get('driver')}" if "driver" in h else "") + "."]
          if (h := env.get("host")) else []),
        f"* Pair ({result['preset']}, random bf16 weights): target hidden {t['hidden_size']}, "
        f"{t['num_hidden_layers']} layers, {t['num_attention_heads']}/{t['num_key_value_heads']} heads, "
        f"head_dim {t['head_dim']}, FFN {t['intermediate_size']}, vocab {t['vocab_size']}; draft "
        f"{d['num_hidden_layers']} layers, draft vocab {d['draft_vocab_size']}, Markov rank {d['markov_rank']}, "
        f"γ = {cfg['gamma']}.",
        f"* Each request has {cfg['context']} tokens of context; a step verifies γ+1 = {cfg['gamma'] + 1} tokens. "
        f"The aoti graphs attend over a static window of {cfg['max_seq']} keys with the position mask. "
        f"aoti plugins: {sec.get('aoti_plugins', cfg.get('plugin_impl'))}"
        f"{' (the Triton kernels failed to compile: reference plugins)' if sec.get('aoti_plugin_fallback') else ''}.",
        f"* Device-to-device copy bandwidth measured in the run: {bw.get('GBps', 0):.0f} GB/s (bytes read + "
        f"written). Roofline = (weights + valid KV bytes a step must read) / that bandwidth.",
        f"* Attention kernel (bf16/fp16 on CUDA, `MUSE_SPARK_ATTENTION`): {cfg.get('attention', '—')}; "
        f"few-row linear layers (`MUSE_SPARK_LINEAR`): {cfg.get('linear', '—')}.",
        (f"* torch.compile: mode `{tc['mode']}` over the eager step (caches marked static; "
         + ("one graph per batch size" if tc.get("static_per_batch")
            else "automatic dynamic shapes: batch 1 static, then a dynamic batch") + "). "
         if tc.get("mode") else "* torch.compile: not run (`--skip compile`). ")
        + f"Medians of {cfg['iters']} CUDA-event-timed steps after warm-up. The aoti buckets are "
        f"captured and timed {'smallest' if cfg.get('aoti_order') == 'ascending' else 'largest'} first. "
        "GEMM floor = the step's weight GEMMs alone, back to back: cuBLAS (`F.linear`), and, when the engine "
        "runs its own (the skinny Triton kernel with silu·mul fused, at most 16 rows: batch ≤ 2), those; "
        "`aoti / GEMM floor` is against the engine's GEMMs where measured, else cuBLAS's.",
        "",
        "## Speculative step latency",
        "",
        render_table(result),
        "",
        "## Bytes per step and achieved bandwidth fraction (roofline / measured)",
        "",
        "| batch | weights GB | KV GB | roofline ms | eager | torch.compile | aoti |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in cfg["batches"]:
        by = sec.get("bytes_per_step", {}).get(b) or sec.get("bytes_per_step", {}).get(str(b)) or {}
        r = (sec.get("roofline_ms", {}).get(b) or sec.get("roofline_ms", {}).get(str(b)))
        fr = []
        for name in ("eager", "torch_compile", "aoti"):
            m = _ms(sec, name, b)
            fr.append("—" if m is None or r is None else f"{r / m:.0%}")
        out.append(f"| {b} | {by.get('weights', 0) / 1e9:.2f} | {by.get('kv', 0) / 1e9:.3f} | "
                   f"{(r or 0):.2f} | " + " | ".join(fr) + " |")
    out += ["", "## Tokens per second at mean acceptance length τ (tokens per step)", "",
            "| engine | batch | " + " | ".join(f"τ = {tau}" for tau in TAUS) + " |",
            "|---|---:|" + "---:|" * len(TAUS)]
    for name, rows in sec.get("tokens_per_s", {}).items():
        for b, row in rows.items():
            out.append(f"| {name} | {b} | " + " | ".join(f"{row[str(tau)]:,.0f}" for tau in TAUS) + " |")
    if sec.get("markov"):
        cols = list(next(iter(sec["markov"].values())).keys())
        out += ["", "## The Markov loop alone (γ sequential steps)", "",
                "| batch | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
        for b, row in sec["markov"].items():
            out.append(f"| {b} | " + " | ".join(f"{row[k]['median_ms'] * 1e3:.1f} µs" if "median_ms" in row.get(k, {})
                                                 else "failed" for k in cols) + " |")
    if "aoti_graph_replay" in sec and sec["aoti_graph_replay"]:
        out += ["", "aoti graph replay alone (without the runner's input copies): "
                + ", ".join(f"B={b}: {v['median_ms']:.2f} ms" for b, v in sec["aoti_graph_replay"].items()) + "."]
    if sec.get("aoti_chained"):
        out += ["", "aoti steps chained as the Generator runs them (each step's successor launched, its inputs "
                "advanced on the device, before the step's rows are read; timed together, per step): "
                + ", ".join(f"B={b}: {v['median_ms']:.2f} ms ({v['steps']} steps)" for b, v in sec["aoti_chained"].items())
                + "."]
    for b, r in sec.get("aoti_runner_profile", {}).items():
        out += ["", f"The runner's step, batch {b} (torch.profiler, {r['calls']} calls back to back): "
                f"{r['kernel_ms']:.3f} ms of device events and {r['idle_ms']:.3f} ms idle a call; events beyond the bare replay's: "
                + (", ".join(f"`{k[:60]}` ×{n:g} {ms * 1e3:.1f} µs" for k, (n, ms) in r["beyond_replay"].items())
                   or "none") + "."]
    if sec.get("aoti_host_issue_us"):
        out += ["", "Host time to issue (median, the device idle at the call): "
                + ", ".join(f"B={b}: the runner's step {v['step']:.0f} µs, the replay alone {v['replay']:.0f} µs"
                            + (f", the input copies then the replay {v['fill_replay']:.0f} µs (after waiting for the "
                               f"copies {v['fill_sync_replay']:.0f} µs" if "fill_replay" in v else "")
                            + (f"; the copies and that wait alone {v['fill_sync']:.0f} µs" if "fill_sync" in v else "")
                            + (")" if "fill_replay" in v else "")
                            for b, v in sec["aoti_host_issue_us"].items()) + "."]
    for b, v in sec.get("aoti_step_host_graph", {}).items():
        out += ["", f"`step_host` as one launch (`MUSE_SPARK_HOST_GRAPH=1`: the copy in, the step and the copy out "
                f"captured together), batch {b}: " + (f"failed: {v['error']}" if "error" in v else
                f"{v['one_launch']:.3f} ms against the plain form's {v['plain']:.3f} ms, timed in turns "
                f"({v['one_launch'] / v['plain']:.3f}×); rows equal: {v['equals']}") + "."]
    for b, v in sec.get("aoti_fill_replay", {}).items():
        out += ["", f"The input copies and the replay as the device sees them, batch {b} (CUDA events): launched right "
                f"after the copies {v['then']['median_ms']:.3f} ms, after the host waited for them "
                f"{v['after_sync']['median_ms']:.3f} ms."]
    for b, prof in sec.get("aoti_profile", {}).items():
        out += ["", f"### Where the aoti step's device time goes, batch {b} (torch.profiler, packages called "
                f"without the CUDA graph: {prof['kernel_ms']:.2f} ms of kernels per step)", "",
                "| kernel | launches / step | ms / step | share |", "|---|---:|---:|---:|"]
        out += [f"| `{r['name'][:80]}` | {r['launches']:g} | {r['ms']:.3f} | {r['share']:.0%} |" for r in prof["top"]]
    if sec.get("aoti_matches_eager"):
        out += ["", "Greedy aoti step bit-equal to the eager step on the same inputs (random weights give "
                "near-tied logits, where fused bf16 arithmetic may legitimately flip an argmax): "
                + ", ".join(f"B={b}: {v}" for b, v in sec["aoti_matches_eager"].items()) + "."]
        if sec.get("aoti_emits_as_eager"):
            out.append("Emitted tokens (accepted drafts + bonus) equal to the eager step's: "
                       + ", ".join(f"B={b}: {v}" for b, v in sec["aoti_emits_as_eager"].items()) + ".")
        for b, d in sec.get("aoti_eager_differences", {}).items():
            where = ", ".join(f"{n} ({c})" for n, c in d.get("first_columns", {}).items())
            out.append(f"At B={b}, {d['rows']} of {d['of_rows']} rows differ ({d['entries']} of {d['of_entries']} "
                       "step-output entries)" + (f"; first differing column per row: {where}." if where else "."))
    if sec.get("torch_compile", {}).get("skipped"):
        out += ["", f"torch.compile not measured for {sec['torch_compile']['skipped']}."]
    for name, sub in sec.get("variants", {}).items():  # timed in the same run, after the default
        switches = " ".join(f"{k}={v}" for k, v in sub["env"].items())
        out += ["", f"### Variant `{name}` ({switches}), beside the default aoti step", "",
                "| batch | aoti ms | default aoti ms | variant / default | graph replay ms | kernels ms / replay | "
                "launches / replay | greedy step = eager (same switches) |",
                "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for b, t in sub.get("aoti", {}).items():
            base, ms = _ms(sec, "aoti", b), t["median_ms"]
            rep = sub.get("aoti_replay_profile", {}).get(b, {})
            replay = sub.get("aoti_graph_replay", {}).get(b, {}).get("median_ms")
            launches = sum(n for n, _ in rep["all"].values()) if rep.get("all") else None
            cells = [f"{ms:.3f}", "—" if base is None else f"{base:.3f}", "—" if base is None else f"{ms / base:.3f}",
                     "—" if replay is None else f"{replay:.3f}",
                     "—" if "kernel_ms" not in rep else f"{rep['kernel_ms']:.3f}",
                     "—" if launches is None else f"{launches:g}", str(sub.get("aoti_matches_eager", {}).get(b))]
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        for b, r in sub.get("aoti_pdl", {}).items():  # the PDL variant's graphs: the edges' two ports, plain edges
            p_, lo, pe = r["programmatic"], r["launch_order"], r["plain_edges"]
            out.append(f"* B={b}: {p_['edges']} edges programmatic (graph of {p_['kernels']} kernels). Replay: "
                       f"programmatic port {p_['replay']['median_ms']:.3f} ms; launch-order port "
                       f"{lo['replay']['median_ms']:.3f} ms (step equal: {lo['equals']}); the same kernels with plain "
                       f"edges {pe['replay']['median_ms']:.3f} ms (step equal: {pe['equals']}).")
        for e in sub.get("aoti_errors", []) + ([sub["aoti_error"]] if "aoti_error" in sub else []):
            out.append(f"* failed: {str(e).splitlines()[0][:300]}")
    for b, r in sec.get("aoti_context_stream", {}).items():  # the same packages, the draft context in line
        out += ["", f"Draft context on a second stream (the default on CUDA), batch {b}: replay "
                f"{r['side_replay']['median_ms']:.3f} ms; in line on one stream {r['serial_replay']['median_ms']:.3f} ms "
                f"(greedy step equal: {r['equals']})"
                + (f"; the host's time to issue the input copies and the launch: {h['side_fill_replay']:.0f} µs, in line "
                   f"{h['serial_fill_replay']:.0f} µs" if (h := r.get("host_issue_us")) else "") + "."]
    for b, got in sec.get("aoti_interleaved_replay", {}).items():  # the graphs timed in turns
        base = got.get("aoti")
        turns = sec.get("in_turns", {}).get(b, {})
        out += ["", f"Step graphs replayed in turns, batch {b} (median of the rounds' medians): " + ", ".join(
            f"`{label}` {ms:.3f} ms" + (f" ({ms / base:.3f}×)" if base and label != "aoti" else "")
            for label, ms in got.items()) + "."
            + (f" The copy timed in the same rounds: {turns['copy_GBps']:.0f} GB/s, so a roofline of "
               f"{turns['roofline_ms']:.2f} ms and the default step graph at **{turns['aoti_replay_over_roofline']:.3f}×** "
               "it (the replay alone; the table's figure is the runner's step, timed right after the compile)."
               if "aoti_replay_over_roofline" in turns else "")]
    idle = [f"`{label}` B={b} {r['idle_ms']:.3f} ms"
            for label, sub in [("aoti", sec)] + [(f"aoti {n}", v) for n, v in sec.get("variants", {}).items()]
            for b, r in sub.get("aoti_replay_profile", {}).items() if "idle_ms" in r]
    if idle:
        out += ["", "Device idle between the events of a replay (torch.profiler): " + ", ".join(idle) + "."]
    # (the Markov kernel's error flag per batch is a failure only where it is set)
    errors = {k: v for k, v in sec.items() if "error" in k and not (k.endswith("error_flag") and not any(v.values()))}
    errors.update({f"{k}.error": v["error"] for k, v in sec.items() if isinstance(v, dict) and "error" in v})
    if errors:
        out += ["", "## Failures in this run", ""] + [f"* `{k}`: {str(v).splitlines()[0][:300]}"
                                                       for k, v in errors.items()]
    return "\n".join(out) + "\n"


def batch_list(text: str) -> list[int]:
    """``--batches``: comma-separated positive batch sizes, ``1,8,32``."""
    try:
        batches = [int(x) for x in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive batch sizes such as 1,8,32, got {text!r}")
    return batches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="muse-spark-8b")
    p.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    p.add_argument("--batches", type=batch_list, default=[1, 8, 32], help="comma-separated, e.g. 1,8,32")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per request")
    p.add_argument("--max-seq", type=int, default=None, help="static key window (default context + 128)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=None, help="override the target's layer count (quick runs)")
    p.add_argument("--draft-layers", type=int, default=None)
    p.add_argument("--plugins", choices=["auto", "inline", "triton"], default="auto")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--compile-static", action="store_true",
                   help="torch.compile each batch size statically (default: torch's automatic dynamic shapes, "
                        "i.e. batch 1 static, then one graph with a dynamic batch)")
    p.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="comma-separated sections to skip: eager, compile, aoti")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="skip torch.compile beyond batch 1 when its recompile would end after this many seconds")
    p.add_argument("--profile", action="store_true",
                   help="also profile the aoti step's kernels per batch (a table of the top kernels)")
    p.add_argument("--aoti-ascending", action="store_true",
                   help="capture and time the aoti buckets smallest first (default: largest first); a batch-1 "
                        "step that is faster this way depends on what ran before it (docs/benchmarks.md)")
    p.add_argument("--attention-cache", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without the attention kernel doing the q/k norm "
                        "and cache write (MUSE_SPARK_ATTENTION_CACHE=0: the norm kernel, then the attention), "
                        "beside the default (fused)")
    p.add_argument("--pdl", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without PDL (MUSE_SPARK_PDL=0: no kernel waits, "
                        "plain graph edges), beside the default (PDL; its replay is also timed with the edges' "
                        "launch-order port and with plain edges)")
    p.add_argument("--pdl-trigger", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with the small kernels only waiting "
                        "(MUSE_SPARK_PDL_TRIGGER=0), not triggering their dependents first, beside the default")
    p.add_argument("--pdl-gemm-trigger", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with the GEMMs only waiting "
                        "(MUSE_SPARK_PDL_GEMM_TRIGGER=0), beside the default (they trigger their dependents after "
                        "their weight stream)")
    p.add_argument("--rope-table", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without the RoPE table the qkv GEMM's launch "
                        "writes for the q/k norm kernel (MUSE_SPARK_ROPE_TABLE=0), beside the default (with it)")
    p.add_argument("--linear-residual", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with the o and down projections' launches doing "
                        "the gated residual after them (MUSE_SPARK_LINEAR_RESIDUAL=1), beside the default")
    p.add_argument("--accept-kernels", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with Inductor's compile of the acceptance rule "
                        "(MUSE_SPARK_ACCEPT_KERNELS=0), beside the default (its three Triton kernels)")
    p.add_argument("--attention-splits", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with one split of the window an attention "
                        "program (MUSE_SPARK_ATTENTION_SPLITS=1), beside the default (the launcher's choice: "
                        "several from batch 4)")
    p.add_argument("--work-dir", default="/tmp/muse_spark_bench", help="where the aoti packages are compiled")
    p.add_argument("--json", default="docs/benchmarks.json")
    p.add_argument("--markdown", default="docs/benchmarks.md")


def main(argv: list[str] | None = None, prog: str = "python scripts/bench.py") -> int:
    """``scripts/bench.py``'s entry point (the CLI's ``bench`` subcommand calls ``run``)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args, f"{prog} " + " ".join(sys.argv[1:] if argv is None else argv))


def run(args, command: str) -> int:
    args.command = command.strip()
    Bench(args).run()
    return 0
