"""The attention at the Muse-Spark step shape on one GPU: the kernels side by side, and where the fused
attention + cache write spends its time.

    python benchmarks/attention.py [--batches 1,8,32] [--context 1024] [--window 1152] [--sweep]
    python benchmarks/attention.py --cache [--batches 1] [--layers 32] [--splits 1,3,9] [--ncu]
    python benchmarks/attention.py --paged [--batches 1,8,32] [--pages 16,64] [--layers 32]

Kernels (the default mode): the inputs are as the step's layer package passes them: whole KV caches
(one spare row) and each request's slot. For each batch: the split-KV Triton kernel (the default,
reading the cache rows in place), the SDPA path (``MUSE_SPARK_ATTENTION=sdpa``: rows gathered, unseen
keys zeroed, then SDPA) and the fp32 einsum reference, each captured 16× in a CUDA graph and timed by
its replays (as inside the step's graph, without Python's launch cost). The roofline is the K/V bytes
the step must read (the requests' lengths, not the window) over the measured copy bandwidth. Prints a
table of µs, ratio to the roofline and the largest deviation from the reference; 37 layers (32 target
+ 5 draft) of this is the attention share of the speculative step. ``--sweep`` adds the kernel under
each configuration of ``SWEEP`` (``launch_attention(config=...)``). Every run times the bounds form
under other splits and with 1–9 splits a program (``SPLITS``), each against the default's bits.

``--cache``: the fused attention + cache write (``MUSE_SPARK_ATTENTION_CACHE=1``, the default) and its
stages. Each variant runs the step's attention shape (γ + 1 = 8 queries, 32/8 heads × 128, the mask in
bounds form over the window, the given context) for ``--layers`` layers with their own caches, captured
in a CUDA graph and timed by its replays; variants leave one stage of the fused kernel out, so
differences place its time (timing only: ``no_rope`` changes the result):

* ``norm_cache+attention``: the two-kernel path (``head_norm_rope_cache`` then the attention);
* ``norm_cache`` / ``attention``: each alone; ``norm_cache_no_rope``: the norm kernel without the rotation;
* ``norm_cache_table`` (``+attention``): the norm kernel reading the step's RoPE table
  (``launch_rope_table``, computed once a pass over the layers, its time shared by them);
* ``fused``: ``launch_attention(new_kv=...)``, the fused path; ``fused_table``: reading the RoPE table;
* ``fused_no_rope``: the same without the rotation (no cos/sin/pow);
* ``fused_no_store``: positions past the caches, so no program stores new keys (the barrier stays);
* ``fused_table SPLITS=g`` (``--splits``): ``fused_table`` with g splits of the window a program
  (the default lets the launcher choose: ``splits_per_program``); checked bit for bit against it.

``--paged``: paged against slot caches at each batch (``--pages`` block sizes, 16 and 64 by default): the
attention and the fused attention + cache write over ``--layers`` layers, reading the same keys in place or
through shuffled block tables with int32 and int64 block offsets (``TABLE_LOADS``); each paged output checked
bit for bit against the slot caches'.

``--ncu`` (with ``--cache``): each kernel once, between cudaProfilerStart/Stop, for Nsight Compute
(``ncu --clock-control none --profile-from-start off ... python benchmarks/attention.py --cache --ncu``).

The figures go to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from timing import batch_list, copy_bandwidth, time_fn, time_in_graph  # noqa: E402

# Launch configurations the sweep times (keys of plugins/attention DEFAULT_CONFIG, plus num_stages).
# EARLY_KV gives the same bits as without it (same split and tile); the split and the tile change
# them. (A register cap, maxnreg 96 or 64, was slower at every batch: docs/log.md.)
SWEEP = [dict(SPLIT_T=st, BLOCK_T=bt, num_warps=w, EARLY_KV=e, **({"num_stages": ns} if ns else {}))
         for st, bt in ((64, 64), (128, 64), (256, 64), (128, 32))
         for e in (False, True) for w in (4, 8) for ns in (None, 3)]
SWEEP += [dict(MERGE_CHUNK=c, merge_warps=w) for c, w in ((16, 1), (16, 2), (8, 2), (16, 8), (8, 1))]
# Half the rows a program (two row blocks per (request, KV head, split)): each row's arithmetic is
# row-local, so the bits should not change (the sweep records whether they equal the default's);
# fewer registers a program (247 at 32 rows on the H200: two programs an
# SM), for the batch-8/32 steps, where the kernel is occupancy-bound. On the H200 (2026-12-04) sixteen rows
# a program ran fewer instructions and was no faster on the default path (docs/log.md).
SWEEP += [dict(BLOCK_M=16, num_warps=w) for w in (2, 4)]
# The mask in bounds form (plugins.attention.reference.KeyBounds) under a few splits, timed in every run.
BOUNDS_CONFIGS = [dict(SPLIT_T=64, BLOCK_T=64), dict(SPLIT_T=64, BLOCK_T=32), dict(SPLIT_T=256, BLOCK_T=64)]
# Splits a program (SPLITS; the default lets the launcher choose, ``splits_per_program``), the bounds
# form, timed in every run: the same bits as the default (checked), so only the time may differ.
SPLITS_CONFIGS = [dict(SPLITS=g) for g in (1, 2, 3, 5, 9)]


# The step's attention shape in --cache mode: γ + 1 queries, 32 query / 8 KV heads of 128.
H, KV, DH, S = 32, 8, 128, 8
EPS, THETA = 1e-6, 5e5


def _name(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(c.items()))


def kernels(a) -> dict:
    """One target layer's attention at each batch: the Triton kernel (mask and bounds forms, other
    configurations), SDPA and the fp32 einsums, against the K/V roofline."""
    from muse_spark.models.layers import _attend_sdpa
    from muse_spark.plugins.attention.reference import attend_reference, cache_rows, KeyBounds
    from muse_spark.plugins import triton_ops
    from muse_spark.plugins.attention.triton_kernel import DEFAULT_CONFIG, launch_attention, program_splits

    dev = torch.device("cuda")
    H, KV, dh, S, T = 32, 8, 128, a.queries, a.window
    bw = copy_bandwidth(dev)["GBps"]
    rows, out = [], {"copy_GBps": bw,
                     "shape": dict(H=H, KV=KV, head_dim=dh, queries=S, window=T, context=a.context), "batches": {}}
    for B in a.batches:
        g = torch.Generator(device=dev).manual_seed(B)
        q = torch.randn(B, S, H, dh, device=dev, generator=g).bfloat16()
        kc = torch.randn(B + 1, T, KV, dh, device=dev, generator=g).bfloat16()  # + a spare row
        vc = torch.randn(B + 1, T, KV, dh, device=dev, generator=g).bfloat16()
        slots = torch.arange(1, B + 1, device=dev)
        pos = a.context + torch.arange(S, device=dev)
        mask = (torch.arange(T, device=dev)[None, :] <= pos[:, None]).expand(B, S, T).contiguous()
        k, v = cache_rows(kc, vc, mask, slots)
        ref = attend_reference(q, k, v, mask).float()
        kv_bytes = B * (a.context + S) * KV * dh * 2 * 2
        roof_ms = kv_bytes / (bw * 1e9) * 1e3
        res = {"kv_bytes": kv_bytes, "roofline_ms": roof_ms}
        kb = KeyBounds(pos.expand(B, S), T)  # what the models pass: no mask tensor
        cases = [("triton", lambda: triton_ops.attention(q, kc, vc, mask, slots)),
                 ("triton_bounds", lambda: triton_ops.attention(q, kc, vc, kb, slots)),
                 ("sdpa", lambda: _attend_sdpa(q, *cache_rows(kc, vc, mask, slots), mask)),
                 ("einsum_fp32", lambda: attend_reference(q, *cache_rows(kc, vc, mask, slots), mask))]
        if a.sweep:
            cases += [(f"triton {_name(c)}", lambda c=c: launch_attention(q, kc, vc, mask, slots, config=c))
                      for c in SWEEP]
        cases += [(f"triton_bounds {_name(c)}", lambda c=c: launch_attention(q, kc, vc, kb.last, slots, config=c,
                                                                             window=kb.width))
                  for c in BOUNDS_CONFIGS + SPLITS_CONFIGS]
        for name, fn in cases:
            try:
                us, how = time_in_graph([fn], reps=16, replays=a.iters)
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                res[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                print(f"B={B} {name}: {res[name]['error']}", flush=True)
                continue
            got = fn()
            err = (got.float() - ref).abs().max().item()
            res[name] = dict(median_ms=us / 1e3, how=how, max_abs_err=err, x_roofline=us / 1e3 / roof_ms)
            if name == "triton":
                default_out = got
            elif name == "triton_bounds":
                bounds_out = got
                res[name]["splits_per_program"] = program_splits(B, S * H // KV, T, KV, dev)
                print(f"B={B} {name}: {us:.1f} µs (splits a program: {res[name]['splits_per_program']})", flush=True)
            elif name.startswith("triton_bounds"):
                # other split sizes change the bits; splits a program must not (against the bounds default)
                same = default_out if "SPLITS" not in name else bounds_out
                res[name]["bits_equal_default"] = bool(torch.equal(got, same))
                print(f"B={B} {name}: {us:.1f} µs (bits = default: {res[name]['bits_equal_default']})", flush=True)
            elif name.startswith("triton "):
                res[name]["bits_equal_default"] = bool(torch.equal(got, default_out))
        out["batches"][B] = res
        if a.sweep:
            out["default_config"] = _name(DEFAULT_CONFIG)
            for name in sorted((n for n in res if n.startswith("triton ") and "median_ms" in res[n]),
                               key=lambda n: res[n]["median_ms"]):
                print(f"B={B} {name}: {res[name]['median_ms'] * 1e3:.1f} µs ({res[name]['x_roofline']:.1f}×, "
                      f"err {res[name]['max_abs_err']:.1e}, bits = default: {res[name]['bits_equal_default']})",
                      flush=True)
        rows.append(f"| {B} | {roof_ms * 1e3:.1f} | " + " | ".join(
            f"{res[n]['median_ms'] * 1e3:.1f} ({res[n]['x_roofline']:.1f}×, err {res[n]['max_abs_err']:.1e})"
            for n in ("triton", "sdpa", "einsum_fp32")) + " |")
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s; one layer, "
          f"{S} queries × {H}/{KV} heads × {dh}, window {T}, context {a.context}; µs (× roofline, max |err|)\n")
    print("| batch | K/V roofline µs | triton | sdpa | fp32 einsums |\n|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return out


def fused_cache(a, B: int) -> dict:
    """The fused attention + cache write and its stages at batch ``B``, ``a.layers`` layers (µs a layer)."""
    from muse_spark.plugins.attention.triton_kernel import launch_attention, program_splits
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope_cache, launch_rope_table

    dev = torch.device("cuda")
    T = a.window
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, S, H + KV, DH, device=dev, generator=g).bfloat16()  # the layer's raw q and k heads
    v = torch.randn(B, S, KV, DH, device=dev, generator=g).bfloat16()
    slots = torch.arange(B, device=dev)
    pos = (a.context + torch.arange(S, device=dev)).expand(B, S).contiguous()
    past = pos + 4 * T  # outside the caches: nothing is stored
    caches = [(torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16(),
               torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16()) for _ in range(a.layers)]

    step = {}  # per pass over the layers: the RoPE table of the *_table variants

    def norm_cache(kc, vc, positions=pos, rope=True, table=None):
        return launch_head_norm_rope_cache(x, v, positions, EPS, THETA, rope, kc, vc, slots, table=table)

    def attention(q, kc, vc):
        return launch_attention(q, kc, vc, pos, slots, window=T)

    def fused(kc, vc, rope=True, positions=pos, table=None, config=None):
        return launch_attention(x, kc, vc, pos, slots, window=T, new_kv=(v, positions, EPS, THETA, rope), table=table,
                                config=config)

    q0 = norm_cache(*caches[0])
    variants = {
        "norm_cache+attention": lambda kc, vc: attention(norm_cache(kc, vc), kc, vc),
        "norm_cache": lambda kc, vc: norm_cache(kc, vc),
        "norm_cache_no_rope": lambda kc, vc: norm_cache(kc, vc, rope=False),
        "norm_cache_table": lambda kc, vc: norm_cache(kc, vc, table=step["table"]),
        "norm_cache_table+attention": lambda kc, vc: attention(norm_cache(kc, vc, table=step["table"]), kc, vc),
        "attention": lambda kc, vc: attention(q0, kc, vc),
        "fused": lambda kc, vc: fused(kc, vc),
        "fused_table": lambda kc, vc: fused(kc, vc, table=step["table"]),
        "fused_no_rope": lambda kc, vc: fused(kc, vc, rope=False),
        "fused_no_store": lambda kc, vc: fused(kc, vc, positions=past),
    }
    for g in a.splits:  # splits a program (the default: the launcher's choice, splits_per_program)
        variants[f"fused_table SPLITS={g}"] = lambda kc, vc, g=g: fused(kc, vc, table=step["table"],
                                                                         config=dict(SPLITS=g))
    same = torch.equal(fused(*caches[0]), attention(norm_cache(*caches[0]), *caches[0]))
    print(f"B={B}: fused output = norm_cache then attention, bit for bit: {same}", flush=True)
    step["table"] = launch_rope_table(pos, THETA, DH)
    table_same = torch.equal(norm_cache(*caches[0], table=step["table"]), norm_cache(*caches[0]))
    print(f"B={B}: norm_cache with the step's RoPE table = without, bit for bit: {table_same}", flush=True)
    fused_table_same = torch.equal(fused(*caches[0], table=step["table"]), fused(*caches[0]))
    print(f"B={B}: fused with the step's RoPE table = without, bit for bit: {fused_table_same}", flush=True)
    chosen = program_splits(B, S * H // KV, T, KV, dev)
    splits_same = {}
    for g in a.splits:  # output and caches bit for bit as the default's, from the same caches
        runs = []
        for config in (None, dict(SPLITS=g)):
            kc, vc = (c.clone() for c in caches[0])
            runs.append((fused(kc, vc, table=step["table"], config=config), kc, vc))
        splits_same[g] = all(torch.equal(p, q) for p, q in zip(*runs))
    print(f"B={B}: the launcher runs {chosen} splits a program; SPLITS=g gives the default's output and caches "
          f"bit for bit: {splits_same}", flush=True)
    if a.ncu:
        for fn in variants.values():  # compiled and warm before the profiled range
            fn(*caches[0])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step["table"] = launch_rope_table(pos, THETA, DH)
        for name in ("norm_cache", "attention", "fused", "fused_no_rope", "fused_no_store", "fused_table"):
            variants[name](*caches[1])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return {}
    us_per_layer = {}
    for name, fn in variants.items():
        def run(fn=fn, name=name):
            if "table" in name:  # one table a step, for every layer
                step["table"] = launch_rope_table(pos, THETA, DH)
            for kc, vc in caches:
                fn(kc, vc)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        t = time_fn(graph.replay, dev, a.iters)
        us_per_layer[name] = t["median_ms"] * 1e3 / a.layers
        print(f"{name:22} {us_per_layer[name]:7.2f} us a layer", flush=True)
        del graph
    base = us_per_layer["norm_cache+attention"]
    print("\nvariant                 us/layer  vs default path")
    for name, us in us_per_layer.items():
        print(f"{name:22} {us:9.2f} {us / base:8.3f}")
    return dict(fused_equals_default=same, table_equals_in_place=table_same,
                fused_table_equals_in_place=fused_table_same, splits_per_program=chosen,
                splits_equal_default={str(k): v for k, v in splits_same.items()}, us_per_layer=us_per_layer)


# --paged: the block offsets as int32 (the launcher's choice where the pools fit) and int64
TABLE_LOADS = {"int32": {}, "int64": dict(TAB_I32=False)}


def paged(a, B: int) -> dict:
    """Paged against slot caches at batch ``B``, ``a.layers`` layers each with its own caches (µs a layer): the
    attention (bounds form) and the fused attention + cache write, reading the same keys from slot caches in
    place or through block tables of ``a.pages``-position blocks (shuffled over a pool), with int32 and int64
    block offsets (``TABLE_LOADS``); every paged output checked bit for bit against the slot caches'."""
    from muse_spark.plugins.attention.triton_kernel import launch_attention

    dev = torch.device("cuda")
    T = a.window
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, S, H + KV, DH, device=dev, generator=g).bfloat16()  # the layer's raw q and k heads
    q = torch.randn(B, S, H, DH, device=dev, generator=g).bfloat16()
    v = torch.randn(B, S, KV, DH, device=dev, generator=g).bfloat16()
    slots = torch.arange(B, device=dev)
    pos = (a.context + torch.arange(S, device=dev)).expand(B, S).contiguous()
    caches = [(torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16(),
               torch.randn(B + 1, T, KV, DH, device=dev, generator=g).bfloat16()) for _ in range(a.layers)]
    forms = {"slot": (caches, slots)}
    first = {}  # each form's first layer before any timing (the fused runs write the new keys)
    for P in a.pages:
        n = -(-T // P)
        perm = torch.randperm(B * n, device=dev, generator=g)  # request b's block j is pool block perm[b·n + j]
        tables = perm.view(B, n)
        pools = []
        for kc, vc in caches:
            pair = []
            for c in (kc, vc):
                rows = torch.nn.functional.pad(c[:B], (0, 0, 0, 0, 0, n * P - T)).view(B * n, P, KV, DH)
                pool = torch.empty_like(rows)
                pool[perm] = rows
                pair.append(pool)
            pools.append(tuple(pair))
        forms[f"paged P={P}"] = (pools, tables)
    for form, (cs, _) in forms.items():
        first[form] = tuple(c.clone() for c in cs[0])

    def attention(kc, vc, rows, cfg):
        return launch_attention(q, kc, vc, pos, rows, window=T, config=cfg)

    def fused(kc, vc, rows, cfg):
        return launch_attention(x, kc, vc, pos, rows, window=T, new_kv=(v, pos, EPS, THETA, True), config=cfg)

    want = {"attention": attention(*caches[0], slots, {}),
            "fused": fused(*(c.clone() for c in caches[0]), slots, {})}
    us, bits = {}, {}
    for form, (cs, rows) in forms.items():
        for loads, cfg in (TABLE_LOADS.items() if form != "slot" else [("", {})]):
            for kind, fn in (("attention", attention), ("fused", fused)):
                name = f"{kind} {form}" + (f" ({loads})" if loads else "")
                got = fn(*(c.clone() for c in first[form]), rows, cfg)
                bits[name] = bool(torch.equal(got, want[kind]))

                def run(fn=fn, cs=cs, rows=rows, cfg=cfg):
                    for kc, vc in cs:
                        fn(kc, vc, rows, cfg)

                run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                us[name] = time_fn(graph.replay, dev, a.iters)["median_ms"] * 1e3 / a.layers
                del graph
                base = us[f"{kind} slot"]
                print(f"B={B} {name:44} {us[name]:8.2f} us a layer  {us[name] / base:6.3f}× slot  "
                      f"bits = slot: {bits[name]}", flush=True)
    return dict(us_per_layer=us, bits_equal_slot=bits, pages=a.pages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=batch_list, default=None,
                   help="comma-separated, e.g. 1,8,32 (default: 1,8,32; with --cache: 1)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=1152)
    p.add_argument("--queries", type=int, default=8, help="γ + 1 (kernels mode)")
    p.add_argument("--iters", type=int, default=None, help="graph replays (default 20; with --cache 30)")
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel under each SWEEP config")
    p.add_argument("--cache", action="store_true", help="the fused attention + cache write and its stages instead")
    p.add_argument("--layers", type=int, default=32, help="--cache: layers, each with its own caches")
    p.add_argument("--splits", default="1,3,9",
                   help="--cache: SPLITS values timed beside the default (fused_table), comma-separated")
    p.add_argument("--ncu", action="store_true", help="--cache: run each kernel once inside a profiler range (ncu)")
    p.add_argument("--paged", action="store_true",
                   help="paged against slot caches (attention and the fused cache write) instead")
    p.add_argument("--pages", default="16,64", help="--paged: block sizes, comma-separated")
    p.add_argument("--out-dir", default=str(results.RESULTS), help="where the result goes (the common schema)")
    a = p.parse_args(argv)
    a.batches = a.batches or ([1] if a.cache else [1, 8, 32])
    a.iters = a.iters or (30 if a.cache or a.paged else 20)
    a.pages = [int(P) for P in a.pages.split(",") if P]
    if not a.pages or min(a.pages) < 1:
        p.error(f"--pages: block sizes of at least 1 position, got {a.pages}")
    a.splits = [int(g) for g in a.splits.split(",") if g]
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA device")
    if a.paged:
        res, name = {"batches": {str(B): paged(a, B) for B in a.batches}}, "attention_paged"
    elif a.cache:
        res = {"batches": {str(B): fused_cache(a, B) for B in a.batches}}
        if a.ncu:
            return 0
        name = "attention_cache"
    else:
        res, name = kernels(a), "attention"
    config = {k: v for k, v in vars(a).items() if k != "out_dir"}
    print(f"result: {results.write(results.record(name, config, res), Path(a.out_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
