#!/usr/bin/env python3
"""What programmatic dependent launch (PDL) gains on a batch-1 target layer stack, side by side.

    python scripts/pdl_bench.py [--layers 32] [--context 1024] [--json out.json]   # on a CUDA device (sm_90)

Each variant runs the same chain of the step's kernels per layer (batch 1, γ + 1 = 8 rows, the
Muse-Spark-8B shapes): qkv projection → q/k head norm + RoPE → attention over a 1024-key cache
window → o projection → gated residual + next norm → gate/up projection with silu·mul → down
projection → gated residual + next norm, for ``--layers`` layers with their own weights (so
every weight streams from HBM), captured in one CUDA graph and replayed:

* ``cublas``: the linear layers through ``F.linear`` (and silu·mul in torch), the rest the plugin
  kernels: the engine's default path;
* ``triton``: the linear layers through the Triton skinny GEMM (``plugins/linear``);
* ``triton+wait``: the same kernels compiled with the PDL wait (``triton_math.pdl_enter``), normal
  launches: what the wait costs where nothing overlaps;
* ``pdl``: every kernel launched with the PDL attribute (a programmatic edge in the graph), each
  first triggering its dependents' launch, then waiting;
* ``pdl-wait-only``: the same, but the kernels only wait (the dependents launch as programs exit);
* ``pdl+prefetchN``: and each linear program first prefetches N KB of its weight rows into L2;
* ``pdl-mixed``: the small kernels trigger first, the GEMMs only wait; ``+preload`` / ``+prefetchN``:
  the GEMMs after a small kernel load their first weight tiles (registers / N KB into L2) before
  their wait, while the small kernel runs;
* ``triton-coresident`` / ``pdl-coresident``: the linear kernels' stages cut to <= 100 KB of shared
  memory (``coresident_config``), so a GEMM's programs fit beside the running kernel's under PDL;
  ``+preload``: each linear program loads its first weight tiles into registers before its wait.

Prints µs per layer stack, the ratio to the ``cublas`` variant and to the roofline (the weights'
bytes over the device-to-device copy bandwidth measured in the same run), and whether each
variant's output equals the ``triton`` variant's bit for bit (PDL must change no result).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_spark.bench import copy_bandwidth, time_fn  # noqa: E402
from muse_spark.plugins.attention.triton_kernel import launch_attention  # noqa: E402
from muse_spark.plugins.gated_residual.triton_kernel import launch_gated_residual_add  # noqa: E402
from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope  # noqa: E402
from muse_spark.plugins.linear.triton_kernel import default_config, launch_linear, launch_prefetch_rows  # noqa: E402
from muse_spark.runtime.cuda_graph import capture  # noqa: E402

H, KV, DH, D, FFN, ROWS = 32, 8, 128, 4096, 14336, 8


def make_layers(n: int, dev) -> list[dict]:
    def w(rows, cols):
        return (torch.randn(rows, cols, device=dev) * cols ** -0.5).to(torch.bfloat16)

    return [dict(qkv=w((H + 2 * KV) * DH, D), o=w(D, H * DH), gate_up=w(2 * FFN, D), down=w(D, FFN),
                 g1=torch.rand(D, device=dev) * 0.1, g2=torch.rand(D, device=dev) * 0.1,
                 n1=torch.ones(D, device=dev, dtype=torch.bfloat16), n2=torch.ones(D, device=dev, dtype=torch.bfloat16),
                 b1=torch.ones(D, device=dev, dtype=torch.bfloat16), b2=torch.ones(D, device=dev, dtype=torch.bfloat16))
            for _ in range(n)]


def coresident_config(M: int, N: int, K: int, silu_mul: bool) -> dict:
    """The linear kernel's default configuration with its stages fitted into 100 KB of shared memory
    (the chunk, then the stages cut): two programs (the kernel before's and the next one's, under
    PDL) fit one SM (227 KB). The default configurations take 110-160 KB."""
    return default_config(M, N, K, silu_mul, budget=100 * 1024)


_SIDE: dict = {}  # the side stream and sink of the side-prefetch variants (made on first use)


def side_prefetch(w, nbytes: int):
    """Fork: ``nbytes`` of W's rows' leading bytes into L2 on a side stream, from this point of the
    main stream (``launch_prefetch_rows``); → the event the GEMM that reads W waits on (join)."""
    if not _SIDE:
        _SIDE.update(stream=torch.cuda.Stream(), sink=torch.zeros(1 << 12, dtype=torch.int32, device=w.device))
    fork = torch.cuda.Event()
    fork.record()
    _SIDE["stream"].wait_event(fork)
    with torch.cuda.stream(_SIDE["stream"]):
        launch_prefetch_rows(w, nbytes, _SIDE["sink"])
        done = torch.cuda.Event()
        done.record()
    return done


def stack(layers, cache, mask, positions, stream, x, linear: str, pdl: bool, launch_pdl: bool, prefetch: int,
          coresident: bool = False, preload: bool = False, side: int = 0, small_pdl: int | None = None,
          after_small_only: bool = False):
    """One pass over the layers; returns (stream, x). ``side``: bytes of the next GEMM's weights
    prefetched into L2 on a side stream while the small kernels before it run (the o projection's
    during the q/k norm and attention, gate/up's and the next layer's qkv during the gated
    residuals). ``small_pdl``: the PDL mode of the kernels that are not GEMMs, where it differs from
    the GEMMs' ``pdl``; ``after_small_only``: ``prefetch``/``preload`` only in the GEMMs that follow a
    small kernel (qkv, o, gate/up; not down, which follows gate/up's weight stream)."""
    kw = dict(pdl=pdl if small_pdl is None else small_pdl, launch_pdl=launch_pdl)
    main = torch.cuda.current_stream()

    def join(ev):
        if ev is not None:
            main.wait_event(ev)

    def lin(a, wt, silu=False, after_small=True):
        early = after_small or not after_small_only
        if linear == "cublas":
            y = F.linear(a, wt)
            if silu:
                g, u = y.chunk(2, dim=-1)
                y = F.silu(g) * u
            return y
        n = wt.shape[0] // 2 if silu else wt.shape[0]
        config = coresident_config(a.numel() // a.shape[-1], n, a.shape[-1], silu) if coresident else None
        return launch_linear(a, wt, silu_mul=silu, prefetch=prefetch if early else 0, config=config,
                             preload=preload and early, pdl=pdl, launch_pdl=launch_pdl)

    kc, vc = cache
    ev_qkv = None
    for i, L in enumerate(layers):
        join(ev_qkv)
        qkv = lin(x, L["qkv"]).view(1, ROWS, H + 2 * KV, DH)
        ev_o = side_prefetch(L["o"], side) if side else None
        qk = launch_head_norm_rope(qkv[:, :, :H + KV], positions, 1e-6, 5e5, True, **kw)
        attn = launch_attention(qk[:, :, :H], kc, vc, mask, **kw)
        join(ev_o)
        o = lin(attn.view(ROWS, H * DH), L["o"])
        ev_gu = side_prefetch(L["gate_up"], side) if side else None
        stream, x = launch_gated_residual_add(stream, o, L["g1"], L["n2"], 1e-6, False, True, torch.bfloat16,
                                              L["b1"], True, **kw)
        join(ev_gu)
        hdn = lin(x, L["gate_up"], silu=True)
        d = lin(hdn, L["down"], after_small=False)
        ev_qkv = side_prefetch(layers[i + 1]["qkv"], side) if side and i + 1 < len(layers) else None
        stream, x = launch_gated_residual_add(stream, d, L["g2"], L["n1"], 1e-6, False, True, torch.bfloat16,
                                              L["b2"], True, **kw)
    join(ev_qkv)
    return stream, x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=2048, help="the cache window the attention masks (static)")
    p.add_argument("--prefetch-kb", default="16,64", help="comma-separated L2 prefetch sizes per program (KB)")
    p.add_argument("--side-prefetch-mb", default="4,8,16",
                   help="comma-separated MB of each GEMM's weights prefetched into L2 on a side stream during the "
                        "small kernels before it (variants triton+sideN MB)")
    p.add_argument("--mixed-prefetch-kb", default="",
                   help="comma-separated L2 prefetch sizes per program (KB) of the pdl-mixed variants")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    variants = [("cublas", dict(linear="cublas", pdl=False, launch_pdl=False, prefetch=0)),
                ("triton", dict(linear="triton", pdl=False, launch_pdl=False, prefetch=0)),
                ("triton+wait", dict(linear="triton", pdl=1, launch_pdl=False, prefetch=0)),
                ("pdl", dict(linear="triton", pdl=1, launch_pdl=True, prefetch=0)),
                ("pdl-wait-only", dict(linear="triton", pdl=2, launch_pdl=True, prefetch=0))]
    # Co-residency (eleventh session's hypothesis): the engine GEMMs take 110-160 KB of shared memory
    # a program, so under PDL the next GEMM's programs cannot start beside the running ones. With
    # the stages cut to <= 100 KB they can; "preload" also loads each program's first weight tiles
    # into registers before its wait (the weights do not depend on the kernel before).
    variants += [("triton-coresident", dict(linear="triton", pdl=False, launch_pdl=False, prefetch=0, coresident=True)),
                 ("pdl-coresident", dict(linear="triton", pdl=1, launch_pdl=True, prefetch=0, coresident=True)),
                 ("pdl-coresident+preload", dict(linear="triton", pdl=1, launch_pdl=True, prefetch=0, coresident=True,
                                                 preload=True)),
                 ("pdl+preload", dict(linear="triton", pdl=1, launch_pdl=True, prefetch=0, preload=True)),
                 ("pdl-wait-only+preload", dict(linear="triton", pdl=2, launch_pdl=True, prefetch=0, preload=True))]
    # Mixed: the small kernels trigger their dependents first (a GEMM's programs then start beside
    # them and wait), the GEMMs only wait (their dependents start as their programs exit: an early
    # trigger there let the next kernels' programs crowd the GEMM's); "+preload" / "+prefetchN": the
    # GEMMs that follow a small kernel load their first weight tiles before the wait, while the
    # small kernel runs and HBM is idle (the down projection, after gate/up's stream, does not).
    mixed = dict(linear="triton", pdl=2, small_pdl=1, launch_pdl=True, prefetch=0, after_small_only=True)
    variants += [("pdl-mixed", dict(mixed)), ("pdl-mixed+preload", dict(mixed, preload=True))]
    for kb in [int(v) for v in args.mixed_prefetch_kb.split(",") if v]:
        variants.append((f"pdl-mixed+prefetch{kb}", dict(mixed, prefetch=kb << 10)))
    for mb in [int(v) for v in args.side_prefetch_mb.split(",") if v]:
        variants.append((f"triton+side{mb}MB", dict(linear="triton", pdl=False, launch_pdl=False, prefetch=0,
                                                   side=mb << 20)))
    for kb in [int(v) for v in args.prefetch_kb.split(",") if v]:
        variants.append((f"pdl+prefetch{kb}", dict(linear="triton", pdl=1, launch_pdl=True, prefetch=kb << 10)))
        variants.append((f"pdl-wait-only+prefetch{kb}", dict(linear="triton", pdl=2, launch_pdl=True,
                                                             prefetch=kb << 10)))
    if args.only:  # the triton variant always runs: the others' bits are checked against it
        unknown = set(args.only.split(",")) - {n for n, _ in variants}
        if unknown:
            p.error(f"--only: no variant {sorted(unknown)}; the variants: {[n for n, _ in variants]}")
        keep = set(args.only.split(",")) | {"triton", "cublas"}
        variants = [(n, v) for n, v in variants if n in keep]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = make_layers(args.layers, dev)
    kc = torch.randn(1, args.window, KV, DH, device=dev).to(torch.bfloat16)
    vc = torch.randn(1, args.window, KV, DH, device=dev).to(torch.bfloat16)
    positions = torch.arange(args.context, args.context + ROWS, device=dev).view(1, ROWS)
    keys = torch.arange(args.window, device=dev)
    mask = (keys[None, None, :] <= positions[:, :, None])  # [1, S, T]: causal over the window
    stream0 = torch.randn(ROWS, D, device=dev)
    x0 = torch.randn(ROWS, D, device=dev).to(torch.bfloat16)
    wbytes = sum(t.numel() * t.element_size() for L in layers for t in L.values())
    bw = copy_bandwidth(dev)
    roof_us = wbytes / (bw["GBps"] * 1e3)
    print(f"{args.layers} layers, {wbytes / 1e9:.2f} GB of weights; copy bandwidth {bw['GBps']:.0f} GB/s; "
          f"roofline {roof_us:.0f} us", flush=True)

    results, ref = {}, None
    for name, v in variants:
        out = {}

        def run():
            out["r"] = stack(layers, (kc, vc), mask, positions, stream0, x0, **v)

        run()
        torch.cuda.synchronize()
        g, _ = capture(run)
        g.replay()
        torch.cuda.synchronize()
        got = torch.cat([out["r"][0].flatten(), out["r"][1].float().flatten()])
        if name == "triton":
            ref = got.clone()
        t = time_fn(g.replay, dev, iters=args.replays, warmup=2)
        us = t["median_ms"] * 1e3
        results[name] = dict(us=us, min_us=t.get("min_ms", t["median_ms"]) * 1e3, roofline_ratio=us / roof_us,
                             equal_to_triton=None if ref is None else bool(torch.equal(got, ref)))
        del g
    base = results["cublas"]["us"]
    print(f"{'variant':18} {'us':>9} {'vs cublas':>10} {'x roofline':>11}  bits = triton")
    for name, r in results.items():
        print(f"{name:18} {r['us']:9.1f} {r['us'] / base:10.3f} {r['roofline_ratio']:11.3f}  {r['equal_to_triton']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), weight_bytes=wbytes, copy_bandwidth=bw,
                                                   roofline_us=roof_us, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
