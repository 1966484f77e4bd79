#!/usr/bin/env python3
"""What kernel boundaries cost a batch-1 layer stack's GEMMs, against grid barriers, side by side.

    python scripts/chain_bench.py [--layers 32] [--replays 20] [--json out.json]   # on a CUDA device

The stack: per layer, the step's four GEMMs at the Muse-Spark-8B shapes for 8 rows (batch 1,
γ + 1): qkv [6144, 4096] → o [4096, 4096] (its input a fixed stand-in for the attention output)
→ gate/up [2·14336, 4096] with silu·mul → down [4096, 14336], whose output is the next layer's
input. Each layer has its own weights, so every weight streams from HBM (13.96 GB at 32 layers).
Variants, each captured in one CUDA graph and replayed:

* ``engine``: the engine's skinny GEMM (``plugins/linear``, its default configurations), one
  launch per GEMM;
* ``chain-per-phase``: ``plugins/linear/chain_kernel.py``, one launch per GEMM (its work split:
  16-row tiles dealt to one program per SM);
* ``chain-per-layer``: one launch per layer, grid barriers between its four GEMMs;
* ``chain-all``: one launch for the whole stack (a barrier between every two GEMMs);
* ``chain-all+preload``: and each program loads its first weight chunk of the next GEMM before
  it waits at the barrier;
* ``chain-flat-*``: per phase / per layer / all, each program running its tiles of a GEMM as one
  flat stream of (tile, K chunk) steps, so its pipeline does not fill again at every tile (the
  per-tile loop was the suspect when the chain measured 1.7 × the engine's GEMMs, twelfth session);
  ``+next-l2``: and before each barrier every program prefetches into L2 the first ``--next-l2``
  bytes of each weight row of its first tile of the next GEMM; ``@Nstages``: the flat forms with a
  deeper pipeline (``--flat-stages``), more weight bytes in flight per program.

Prints µs per stack, the ratio to ``engine`` and to the roofline (weight bytes over the
device-to-device copy bandwidth measured in the same run), and whether each chain variant's
output equals ``chain-per-phase``'s bit for bit (barriers must change no result) and how far it is
from ``engine``'s (another K chunking: rounding only). docs/benchmarks.md, eleventh session, has
the question it answers: the ~5 µs each GEMM launch costs beyond its stream.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_spark.bench import copy_bandwidth, time_fn  # noqa: E402
from muse_spark.plugins.linear.chain_kernel import DEFAULT_CONFIG, chain_table, launch_chain  # noqa: E402
from muse_spark.plugins.linear.triton_kernel import launch_linear  # noqa: E402

D, QKV, FFN, ROWS = 4096, 6144, 14336, 8


def layout(layers: int) -> tuple[list[dict], dict, int, dict, int]:
    """Weight offsets per layer and GEMM, activation regions per layer (each its own, so no
    region is read twice in one launch), the chain's phases, and the two buffers' sizes."""
    shapes = {"qkv": (QKV, D), "o": (D, D), "gate_up": (2 * FFN, D), "down": (D, FFN)}
    w_off, n = {}, 0
    for L in range(layers):
        for name, (rows, cols) in shapes.items():
            w_off[L, name] = n
            n += rows * cols
    regions, a = {}, 0
    for L in range(layers):
        for name, width in (("x", D), ("attn", D), ("qkv", QKV), ("o", D), ("gu", FFN)):
            regions[L, name] = a
            a += ROWS * width
    regions[layers, "x"] = a  # the last layer's output
    a += ROWS * D
    phases = []
    for L in range(layers):
        phases += [dict(w_offset=w_off[L, "qkv"], N=QKV, K=D, in_offset=regions[L, "x"], out_offset=regions[L, "qkv"],
                        silu=0),
                   dict(w_offset=w_off[L, "o"], N=D, K=D, in_offset=regions[L, "attn"], out_offset=regions[L, "o"],
                        silu=0),
                   dict(w_offset=w_off[L, "gate_up"], N=FFN, K=D, in_offset=regions[L, "o"],
                        out_offset=regions[L, "gu"], silu=1),
                   dict(w_offset=w_off[L, "down"], N=D, K=FFN, in_offset=regions[L, "gu"],
                        out_offset=regions[L + 1, "x"], silu=0)]
    return phases, w_off, n, regions, a


def engine_stack(w, act, phases):
    """The same chain through the engine's GEMM: one launch per GEMM, each writing its output
    region in place (so the stack reads what the chain reads, with no copies)."""
    for ph in phases:
        rows = (2 if ph["silu"] else 1) * ph["N"]
        wt = w[ph["w_offset"]: ph["w_offset"] + rows * ph["K"]].view(rows, ph["K"])
        x = act[ph["in_offset"]: ph["in_offset"] + ROWS * ph["K"]].view(ROWS, ph["K"])
        y = act[ph["out_offset"]: ph["out_offset"] + ROWS * ph["N"]].view(ROWS, ph["N"])
        launch_linear(x, wt, silu_mul=bool(ph["silu"]), out=y)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--block-k", type=int, default=DEFAULT_CONFIG["BLOCK_K"])
    p.add_argument("--stages", type=int, default=DEFAULT_CONFIG["num_stages"])
    p.add_argument("--next-l2", type=int, default=3 * 2 * DEFAULT_CONFIG["BLOCK_K"],
                   help="chain-flat-all+next-l2: bytes of each next-GEMM weight row prefetched into L2 before a "
                        "barrier (default: the pipeline's 3 chunks)")
    p.add_argument("--flat-stages", default="4,5",
                   help="comma-separated pipeline depths for more flat variants (at the default tiles the flat kernel "
                        "takes 99 / 148 / 197 KB of shared memory at 3 / 4 / 5 stages, sm_90 compile)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    phases, _, n_w, regions, n_act = layout(args.layers)
    w = torch.empty(n_w, device=dev, dtype=torch.bfloat16)
    for ph in phases:  # each weight ~ N(0, 1/K), filled in place (no second copy of 14 GB)
        rows = (2 if ph["silu"] else 1) * ph["N"]
        seg = w[ph["w_offset"]: ph["w_offset"] + rows * ph["K"]]
        seg.copy_(torch.randn(seg.numel(), device=dev) * ph["K"] ** -0.5)
    act0 = torch.zeros(n_act, device=dev, dtype=torch.bfloat16)
    for L in range(args.layers):
        act0[regions[L, "attn"]: regions[L, "attn"] + ROWS * D].normal_()
    act0[regions[0, "x"]: regions[0, "x"] + ROWS * D].normal_()
    cfg = dict(DEFAULT_CONFIG, BLOCK_K=args.block_k, num_stages=args.stages)
    table = chain_table(phases, ROWS, w, act0, cfg)
    wbytes = n_w * 2
    bw = copy_bandwidth(dev)
    roof_us = wbytes / (bw["GBps"] * 1e3)
    print(f"{args.layers} layers, {len(phases)} GEMMs, {wbytes / 1e9:.2f} GB of weights; copy bandwidth "
          f"{bw['GBps']:.0f} GB/s; roofline {roof_us:.0f} us; chain config {cfg}", flush=True)

    variants = {
        "engine": lambda act, ctl: engine_stack(w, act, phases),
        "chain-per-phase": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=False, config=cfg),
        "chain-per-layer": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True,
                                                         phases_per_launch=4, config=cfg),
        "chain-all": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True, config=cfg),
        "chain-all+preload": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True, preload=True,
                                                           config=cfg),
        "chain-flat-per-phase": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=False, config=cfg,
                                                              flat=True),
        "chain-flat-per-layer": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True,
                                                              phases_per_launch=4, config=cfg, flat=True),
        "chain-flat-all": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True, config=cfg,
                                                        flat=True),
        "chain-flat-all+next-l2": lambda act, ctl: launch_chain(w, act, table, ctl, ROWS, grid_sync=True, config=cfg,
                                                                flat=True, next_l2=args.next_l2),
    }
    for stages in [int(v) for v in args.flat_stages.split(",") if v]:  # more weight bytes in flight per program
        deeper = dict(cfg, num_stages=stages)
        variants[f"chain-flat-per-phase@{stages}stages"] = (
            lambda act, ctl, c=deeper: launch_chain(w, act, table, ctl, ROWS, grid_sync=False, config=c, flat=True))
        variants[f"chain-flat-all@{stages}stages"] = (
            lambda act, ctl, c=deeper: launch_chain(w, act, table, ctl, ROWS, grid_sync=True, config=c, flat=True))
    out_at = regions[args.layers, "x"]
    results, ref, eng = {}, None, None
    for name, fn in variants.items():
        act = act0.clone()
        ctl = torch.zeros(3, device=dev, dtype=torch.int64)
        fn(act, ctl)  # compile, warm up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(act, ctl)
        g.replay()
        torch.cuda.synchronize()
        got = act[out_at: out_at + ROWS * D].float().clone()
        t = time_fn(g.replay, dev, iters=args.replays, warmup=2)
        us = t["median_ms"] * 1e3
        if name == "engine":
            eng = got
        if name == "chain-per-phase":
            ref = got
        r = dict(us=us, min_us=t["min_ms"] * 1e3, roofline_ratio=us / roof_us, error_flag=int(ctl[2]),
                 equal_to_chain_per_phase=None if ref is None or name == "engine" else bool(torch.equal(got, ref)),
                 max_abs_diff_to_engine=float((got - eng).abs().max()), finite=bool(torch.isfinite(got).all()))
        results[name] = r
        print(f"{name:18} {us:9.1f} us  x{r['roofline_ratio']:.3f} roofline  flag {r['error_flag']}  "
              f"bits = chain-per-phase: {r['equal_to_chain_per_phase']}  |diff to engine| {r['max_abs_diff_to_engine']:.3g}",
              flush=True)
        del g
    base = results["engine"]["us"]
    print(f"\n{'variant':18} {'us':>9} {'vs engine':>10} {'x roofline':>11} {'per GEMM boundary saved (us)':>30}")
    for name, r in results.items():
        saved = (base - r["us"]) / len(phases)
        print(f"{name:18} {r['us']:9.1f} {r['us'] / base:10.3f} {r['roofline_ratio']:11.3f} {saved:30.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), config=cfg, weight_bytes=wbytes, copy_bandwidth=bw,
                                                   roofline_us=roof_us, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
