"""The speculative-step benchmark: eager vs torch.compile vs aoti against the bandwidth roofline.

    python benchmarks/step.py [--preset muse-spark-8b|tiny] [--batches 1,8,32] [--context 1024] \
        [--skip eager,compile,aoti] [--out-dir benchmarks/results] [--markdown report.md]
    muse-spark bench ...            # the same, from a checkout of the repository

On the GPU with the Muse-Spark-shaped preset (random bf16 weights) one run measures, at each batch size:

* the speculative step (draft block → Markov loop → target verify → accept → draft context) of
  (a) the eager engine, (b) ``torch.compile`` of the same eager step (``mode="reduce-overhead"``,
  gpt-fast's method: CUDA graphs, the caches marked as static addresses), (c) the aoti engine's step
  graph replayed from a CUDA graph (the runner the runtime uses: input copies and all);
* the fused Markov loop alone (the engine's plugin implementation, and the reference loop);
* the bytes a step must read (weights + valid KV) against a device-to-device copy bandwidth it
  measures itself: roofline time and achieved fraction; the step's weight GEMMs alone (GEMM floor);
* tokens/s at mean acceptance lengths τ = 1, 3.7, 6.17 (tokens per step, bonus included): B·τ / step time.

Kernel options (``muse_spark/options.py``): the run's are the environment's (``KernelOptions.from_env``:
``MUSE_SPARK_ATTENTION=sdpa python benchmarks/step.py`` times the SDPA step), recorded in the result's
config; the eager engine, the torch.compile baseline and the aoti compiles all take them. The variants
(``--<option> both``) compile and time the aoti step again with a few of them changed (``VARIANTS``).

Timing: CUDA events around each call, warm-up first, median of ``--iters``. KV caches hold random
values at ``context`` positions per request (never zeros). The aoti step graphs compile in worker
processes while the torch.compile baseline compiles; eager timings are taken before either starts
(an eager step is launch-bound and CPU contention would inflate it).

The result goes to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``: date,
device, commit, versions, the exact command), rewritten after every section, so a run cut short
still reports what it measured; ``--markdown`` also writes the run's full report
(``benchmarks/report.py``). On the GPU with the default preset it needs about 40 GB of device memory
and several minutes. ``benchmarks/render.py`` renders the current figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from presets import PRESETS, TAUS, gemm_floor, preset_configs, random_pair  # noqa: E402
from report import render_markdown, render_table  # noqa: E402
from step_aoti import AotiSections  # noqa: E402
from timing import batch_list, copy_bandwidth, host_description, step_bytes, time_fn, time_in_graph  # noqa: E402


# aoti step variants `--attention-cache both` / `--pdl both` / `--pdl-trigger both` / `--rope-table both` /
# `--accept-kernels both` / `--pdl-gemm-trigger both` / `--attention-splits both` compile and time beside the
# default: name -> the KernelOptions fields it changes from the run's options (``variant_options``), which its
# compile jobs carry and the eager step it is checked against runs under. A step compiled with PDL (the default on
# sm_90+) gets its graphs' programmatic edges (runtime.cuda_graph.make_programmatic), as the engine does. The RoPE
# table, the fused attention, PDL with the small kernels' trigger, the acceptance kernels and the GEMMs' late
# trigger are the defaults: their variants are the step without them; likewise several splits of the window an
# attention program (the variant: one split a program).
VARIANTS = {"no_attention_cache": {"attention_cache": False}, "no_pdl": {"pdl": False},
            "pdl_wait_only": {"pdl_trigger": False},
            "no_rope_table": {"rope_table": False},
            "no_accept_kernels": {"accept_kernels": False},
            "pdl_gemm_wait_only": {"pdl_gemm_trigger": False},
            "attention_one_split": {"attention_splits": 1}}
# the variant's --option, where its name is not the option's
VARIANT_OPTION = {"no_rope_table": "rope_table", "no_attention_cache": "attention_cache", "no_pdl": "pdl",
                  "pdl_wait_only": "pdl_trigger", "no_accept_kernels": "accept_kernels",
                  "pdl_gemm_wait_only": "pdl_gemm_trigger", "attention_one_split": "attention_splits"}


def variant_options(name: str, base=None):
    """The kernel options variant ``name`` compiles and runs with: ``base`` (default: the defaults) with
    its ``VARIANTS`` fields."""
    from muse_spark.options import KernelOptions

    return dataclasses.replace(base or KernelOptions(), **VARIANTS[name])


# The packages of one bucket's step (``step_{part}_b{B}``, builder.aoti.graph_plan_names).
STEP_PARTS = ("draft", "layer", "verify", "context")


class Bench(AotiSections):
    def __init__(self, args):
        import torch

        self.a = args
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(args.device)
        self.result: dict = {"command": args.command, "preset": args.preset, "sections": {}}
        self.t0 = time.perf_counter()
        self.replays: dict = {}  # batch -> {label: CUDA-graph step}, for interleaved_replays
        from muse_spark.options import KernelOptions

        self.options = KernelOptions.from_env()  # the run's kernel options (the variants change a few)
        config = {k: v for k, v in vars(args).items() if k not in ("command", "out_dir", "markdown")}
        self.doc = results.record("step", config, self.result, command=[args.command],
                                  device=None if self.device.type == "cuda" else results.cpu_name())
        self.path: Path | None = None

    def log(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def save(self) -> None:
        """Write the result (and the markdown) as it stands: a run cut short keeps what it measured."""
        self.doc["results"] = self.result
        self.path = results.write(self.doc, Path(self.a.out_dir))
        if self.a.markdown:
            Path(self.a.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(self.a.markdown).write_text(render_markdown(self.result))

    def run(self) -> dict:
        """Every section, under the run's kernel options (the variants' sections under their own)."""
        from muse_spark.options import use_options

        with use_options(self.options):
            return self._run()

    def _run(self) -> dict:
        import torch

        from muse_spark.builder.aoti import (compile_job_cached, graph_jobs, inductor_configs, int64_indexing,
                                             markov_workspaces, resolve_plugin_impl)
        from muse_spark.graphs.parts import SpecPair, weight_specs
        from muse_spark.runtime.engine import EagerEngine

        a, dev = self.a, self.device
        batches = sorted(a.batches)
        if a.pair:
            from muse_spark.checkpoint import load_pair

            self.log(f"loading the pair {a.pair} on {dev}")
            target, draft = load_pair(Path(a.pair) / "target", Path(a.pair) / "draft", device=dev,
                                      kv_cache_dtype=a.kv_cache_dtype)
            tcfg, dcfg = target.cfg, draft.cfg
        else:
            tcfg, dcfg = preset_configs(a.preset, a.layers, a.draft_layers)
            if a.kv_cache_dtype is not None:
                tcfg = dataclasses.replace(tcfg, kv_cache_dtype=a.kv_cache_dtype)
        g = dcfg.block_size
        max_seq = a.max_seq or (a.context + 128)
        slots = max(batches) + 1  # + the scratch slot the aoti engine pads with
        self.result.update(env=self.environment(), config=dict(
            target=tcfg.to_dict(), draft=dcfg.to_dict(), gamma=g, context=a.context, max_seq=max_seq,
            batches=batches, iters=a.iters, aoti_order="ascending" if a.aoti_ascending else "descending",
            options=self.options.to_dict()))
        impl = resolve_plugin_impl(a.plugins, str(dev)) if "aoti" not in a.skip else "inline"
        self.result["config"]["plugin_impl"] = impl

        if not a.pair:
            self.log(f"random {a.preset} pair on {dev}")
            target, draft = random_pair(tcfg, dcfg, dev)
        from muse_spark.models.layers import attention_path, linear_path

        self.result["config"]["attention"] = attention_path(dev, target.dtype, self.options)
        self.result["config"]["linear"] = linear_path(dev, target.dtype, self.options)
        eng = EagerEngine(target, draft, max_batch=slots, max_seq=max_seq, device=dev, options=self.options)
        fill = torch.Generator(device=dev).manual_seed(1)  # seeded: every run checks the same step
        for t in eng.target_cache.k + eng.target_cache.v + eng.draft_cache.k + eng.draft_cache.v:
            if t.dtype == torch.float8_e4m3fn:  # (an FP8 cache: E4M3 codes of normal values, scales 1)
                t.copy_(torch.empty(t.shape, device=dev, dtype=torch.bfloat16).normal_(generator=fill))
            else:
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
        if linear_path(dev, target.dtype, self.options) == "triton":
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
                              out_dir=out_dir, with_prefill=False, markov_words=self.markov_words,
                              options=self.options)
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Variants: the same packages compiled under the variant's kernel options (VARIANTS).
            vjobs = {name: [dict(j, options=variant_options(name, self.options).to_dict(),
                                 out=str(out_dir / name / Path(j["out"]).name)) for j in jobs]
                     for name in VARIANTS if getattr(a, VARIANT_OPTION.get(name, name)) == "both"}
            for name in vjobs:
                (out_dir / name).mkdir(parents=True, exist_ok=True)
            n_jobs = len(jobs) + sum(map(len, vjobs.values()))
            pool = ProcessPoolExecutor(max_workers=n_jobs, mp_context=multiprocessing.get_context("spawn"))
            threads = max(1, (os.cpu_count() or 1) // (n_jobs + 1))
            futures = [pool.submit(compile_job_cached, dict(j, compile_threads=threads)) for j in jobs]
            vfutures = {name: [pool.submit(compile_job_cached, dict(j, compile_threads=threads)) for j in js]
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
            # the body, without the decorators' inference mode and kernel options: compile_for and
            # time_compiled hold the inference mode around it, run() the options (the engine's: the run's)
            raw_step = EagerEngine.step.__wrapped__

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
                retry = [pool.submit(compile_job_cached, dict(j, impl="inline", compile_threads=threads)) for j in jobs]
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
                sub = sec.setdefault("variants", {}).setdefault(name, {"options": VARIANTS[name], "compiled": []})
                for f in fs:
                    try:
                        sub["compiled"].append(f.result()["name"])
                    except Exception as e:
                        sub.setdefault("aoti_errors", []).append(f"{type(e).__name__}: {e}"[:3000])
                        self.log(f"aoti {name}: compile failed: {str(e)[:1000]}")
            pool.shutdown()
            sec["aoti_compile_s"] = {k: v["export_s"] + v["compile_s"] for k, v in compiled_files.items()}
            sec["aoti_cached"] = sorted(k for k, v in compiled_files.items() if v.get("cached"))  # (build cache)
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
                                      work_dir=Path(a.work_dir) / name, options=variant_options(name, self.options),
                                      label=f"aoti {name}")
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
        self.log(f"result: {self.path}")
        return self.result

    def markov_section(self, draft, batches, impl) -> None:
        """The Markov loop alone: the reference (eager ops; it cannot be graph-captured, its
        scalar constants are host→device copies) and the Triton op when it imports (graph replay)."""
        import torch

        from muse_spark.plugins import dispatch
        from muse_spark.plugins.dispatch import plugin_impl
        from muse_spark.graphs.parts import MARKOV_ERROR_WORD

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
                            # graph's own launch is amortized (benchmarks/markov.py's method).
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



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="muse-spark-8b")
    p.add_argument("--pair", default=None,
                   help="time this checkpoint pair (a `muse-spark make-pair` folder: target/, draft/) instead of "
                        "the preset's random weights; benchmarks/generation.py --pair measures its tokens/s at its "
                        "real acceptance")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="the target's KV cache: auto (the compute dtype) or fp8 (E4M3; docs/fp8.md). Default: the "
                        "pair's checkpoint's, else auto")
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
                        "step that is faster this way depends on what ran before it (docs/log.md)")
    p.add_argument("--attention-cache", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without the attention kernel doing the q/k norm "
                        "and cache write (attention_cache=False: the norm kernel, then the attention), "
                        "beside the default (fused)")
    p.add_argument("--pdl", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without PDL (pdl=False: no kernel waits, "
                        "plain graph edges), beside the default (PDL; its replay is also timed with the edges' "
                        "launch-order port and with plain edges)")
    p.add_argument("--pdl-trigger", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with the small kernels only waiting "
                        "(pdl_trigger=False), not triggering their dependents first, beside the default")
    p.add_argument("--pdl-gemm-trigger", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with the GEMMs only waiting "
                        "(pdl_gemm_trigger=False), beside the default (they trigger their dependents after "
                        "their weight stream)")
    p.add_argument("--rope-table", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step without the RoPE table the qkv GEMM's launch "
                        "writes for the q/k norm kernel (rope_table=False), beside the default (with it)")
    p.add_argument("--accept-kernels", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with Inductor's compile of the acceptance rule "
                        "(accept_kernels=False), beside the default (its three Triton kernels)")
    p.add_argument("--attention-splits", choices=["off", "both"], default="off",
                   help="both: also compile and time the aoti step with one split of the window an attention "
                        "program (attention_splits=1), beside the default (the launcher's choice: "
                        "several from batch 4)")
    p.add_argument("--work-dir", default="/tmp/muse-spark-bench", help="where the aoti packages are compiled")
    p.add_argument("--out-dir", default=str(results.RESULTS),
                   help="where the result goes, in the common schema (default: benchmarks/results)")
    p.add_argument("--markdown", default=None, help="also write the run's full report here (Markdown)")




def main(argv: list[str] | None = None, prog: str = "python benchmarks/step.py") -> int:
    """The benchmark's entry point (``muse-spark bench`` calls it with its own ``prog``)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.command = " ".join([prog, *argv]).strip()
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
