#!/usr/bin/env python3
"""The skinny linear kernel (plugins/linear) against cuBLAS, on the step's weight shapes.

    python benchmarks/linear.py [--sweep] [--batches 1,8] [--out-dir benchmarks/results]     # on a CUDA device

Every time is graph-timed (``timing.time_in_graph``) with the calls rotating over
enough copies of the weight that it never stays in the L2 cache, as in a step, where each
weight is read once. Prints, per shape, µs per call for cuBLAS (``plugins.linear.reference.linear_reference``:
``F.linear``, then silu·mul for the fused gate/up) and the kernel, and the weight stream's GB/s;
then the step's whole GEMM sequence (``presets.gemm_floor``): cuBLAS, and the engine's
GEMMs under the kernel option ``linear="triton"`` (the kernel with its default configurations, silu·mul
fused). ``--sweep`` times the launch configurations per shape and reports each shape's fastest;
``--sweep-fp8`` the W8A16 form's (``fp8_configs``), each checked against its default's bits. ``--shapes``
picks shapes by name.
Each shape also times the W8A16 form (``--fp8``, the default: the same kernel streaming an FP8 E4M3
copy of the weight with per-row scales, ``launch_linear(scale=)``, half the bytes) in its default
configuration, beside the bf16 kernel and cuBLAS, with its error against the dequantized weight's
cuBLAS product; W8A8 (``models.layers.fp8_linear_w8a8``, on FP8 hardware: eager, and under ``torch.compile`` as
the compiled engines run it, its activations' quantization fused), the W8A8 candidate in the skinny kernel
(``launch_linear(w8a8=True)``: FP8 operands on both sides of the MMA), and the W8A16 reference
(dequantize per call, then cuBLAS) at every row count (``--batches 8,32``: the verification GEMMs W8A8
takes).
The figures go to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``), rewritten
after every shape.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

from muse_spark.plugins.linear.reference import linear_reference
from muse_spark.plugins.linear.triton_kernel import MAX_ROWS, default_config, launch_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from timing import batch_list, time_in_graph  # noqa: E402

L2_BYTES = 256 << 20  # rotate over at least this many bytes of weights


def shapes(hidden=4096, ffn=14336, qkv=6144, vocab=131072, draft_vocab=32768, fc=20480):
    """(name, M, N, K, silu_mul): the step's GEMMs at batch 1 (M = 8 target rows, 7 draft rows)."""
    return [("qkv", 8, qkv, hidden, False), ("o", 8, hidden, hidden, False),
            ("gate_up+silu", 8, 2 * ffn, hidden, True), ("down", 8, hidden, ffn, False),
            ("lm_head", 8, vocab, hidden, False), ("draft_lm_head", 7, draft_vocab, hidden, False),
            ("draft_fc", 7, hidden, fc, False)]


def configs(M: int = 8, silu: bool = False):
    """--sweep: the bf16 kernel's candidates for M rows. Up to ``MAX_ROWS`` rows narrow weight tiles over long
    chunks (the weight stream). Past it (batch 8: 64 rows) every weight tile re-reads x's M rows from L2, which
    in 16-row tiles is four times the weight's bytes (the down projection at 118.6 µs against cuBLAS's 36.6 on an
    H200, docs/log.md): wide tiles (64–128 weight rows, short chunks) read x a quarter as often, and split-K
    launches (``SPLIT_K``, not with silu·mul) keep enough of them streaming where N is short."""
    if M <= MAX_ROWS:
        return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                for bn, warps in ((16, 2), (16, 4), (32, 4), (64, 4), (64, 8))
                for bk, stages in itertools.product((128, 256, 512), (3, 4, 6))]
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **({"SPLIT_K": sk} if sk > 1 else {}))
            for bn in (64, 128) for bk in (64, 128) for warps in (4, 8) for stages in (3, 4)
            for sk in ((1,) if silu else (1, 2, 4))]


def fp8_configs(silu: bool = False):
    """--sweep-fp8: the FP8 forms' candidates. An FP8 weight tile is half the bytes of a bf16 one (longer chunks; in
    W8A8 the rows' tile too). The 8-warp launches (for W8A16's conversions in registers) were slower on every
    projection at 8 rows on an H100 (docs/log.md), so they are no longer candidates. Without silu·mul also split-K
    launches (``SPLIT_K``: wider tiles over parts of K, their sums added by a second kernel): more programs streaming
    where 4,096 outputs in wide tiles leave SMs idle."""
    out = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
           for bn, w in ((16, 2), (32, 4), (64, 4)) for bk in (256, 512, 1024) for st in (3, 4)]
    if not silu:
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=st, SPLIT_K=sk)
                for sk in (2, 4) for bn in (32, 64) for bk in (256, 512) for st in (3, 4)]
    return out


def operands(M, N, K, dev):
    copies = max(1, min(16, math.ceil(L2_BYTES / (N * K * 2))))
    ws = [torch.randn(N, K, device=dev).to(torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(M, K, device=dev).to(torch.bfloat16)
    return x, ws


def time_calls(fn, x, ws) -> float:
    calls = [lambda w=w: fn(x, w) for w in ws]
    us, _ = time_in_graph(calls, reps=max(4, len(ws)), replays=10)
    return us


def sweep_configs(launch, x, pairs, deadline: float, check, silu: bool = False) -> list[dict]:
    """Each of ``fp8_configs(silu)`` (until ``deadline``, a ``time.time()``): ``launch(x, w8, scale, config)`` timed
    over the FP8 copies ``pairs`` (µs), with ``check``'s figures of its output on the first; a configuration that
    does not compile gets its error."""
    out = []
    for cfg in fp8_configs(silu):
        if time.time() > deadline:
            break
        try:
            us = time_calls(lambda x, p, cfg=cfg: launch(x, p[0], p[1], cfg), x, pairs)
            extra = check(launch(x, pairs[0][0], pairs[0][1], cfg))
        except Exception as e:  # noqa: BLE001 — a configuration that does not compile
            out.append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:100]}"))
            continue
        out.append(dict(cfg, us=us, **extra))
    return out


def best(r: dict, key: str, label: str) -> None:
    """``r[key + "_best"]``: the fastest of ``r[key + "_configs"]``, printed beside the default
    (``r[key + "_us"]``)."""
    ok = [c for c in r[f"{key}_configs"] if "us" in c]
    if ok:
        r[f"{key}_best"] = min(ok, key=lambda c: c["us"])
        print(f"{label} sweep: default {r[f'{key}_us']:.1f} µs, fastest {r[f'{key}_best']}", flush=True)


def fp8_figures(x, ws, silu: bool, sweep: bool = False, deadline: float = math.inf) -> dict:
    """The FP8 forms on FP8 copies of ``ws`` (per-row absmax scales): the W8A16 kernel (µs a call, the FP8 weight
    stream's GB/s, relative error against cuBLAS on the dequantized weight; at any row count: past ``MAX_ROWS``,
    where the engines run W8A8, ``fp8_in_op_range`` is false), W8A8
    (``fp8_linear_w8a8``: the rows quantized per token, ``torch._scaled_mm``; eager and compiled, each one's error
    against its spec; and ``launch_linear(w8a8=True)``, the skinny kernel's W8A8 form, swept as the W8A16 kernel
    is) and
    the W8A16 reference (the weight dequantized per call, then cuBLAS: what runs without either). ``sweep``: the
    skinny kernel's W8A8 form, then its W8A16 form, under each of ``fp8_configs()`` too (until ``deadline``, a
    ``time.time()``), the fastest in ``w8a8_skinny_best`` and ``fp8_best``."""
    from muse_spark.models.layers import (FP8, FP8_MAX, Fp8Weight, fp8_linear_reference, fp8_linear_w8a8,
                                          fp8_w8a8_reference)
    from muse_spark.plugins.linear.triton_kernel import MAX_ROWS

    scales = [(w.float().abs().amax(1) / FP8_MAX).clamp_min(1e-12) for w in ws]
    w8s = [(w.float() / s[:, None]).to(FP8) for w, s in zip(ws, scales)]
    fws = [Fp8Weight(w8, s[:, None], None, x.dtype) for w8, s in zip(w8s, scales)]
    r = {}
    pairs = list(zip(w8s, scales))
    try:  # (past MAX_ROWS the engines run W8A8; the kernel is timed there too, for the choice between them)
        us = time_calls(lambda x, ws_: launch_linear(x, ws_[0], silu, scale=ws_[1]), x, pairs)
        out = launch_linear(x, w8s[0], silu, scale=scales[0]).float()
    except Exception as e:  # noqa: BLE001 — rows whose tiles do not fit
        r["fp8_error"] = f"{type(e).__name__}: {str(e)[:100]}"
    else:
        ref = linear_reference(x, (w8s[0].float() * scales[0][:, None]).to(x.dtype), silu).float()
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        r.update(fp8_us=us, fp8_GBps=w8s[0].numel() / us / 1e3, fp8_rel_err=err,
                 fp8_in_op_range=x.shape[0] <= MAX_ROWS)
    if torch.cuda.get_device_capability(x.device) >= (8, 9):
        r["w8a8_us"] = time_calls(lambda x, fw: fp8_linear_w8a8(x, fw, silu), x, fws)
        ref = fp8_w8a8_reference(x, fws[0], silu).float()

        def rel_err(out):
            return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()

        r["w8a8_rel_err"] = rel_err(fp8_linear_w8a8(x, fws[0], silu))
        # as the compiled engines run it: the activations' quantization compiled with the product (its own Inductor
        # kernels, not the eager ops timed above)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w8, s: fp8_linear_w8a8(x, Fp8Weight(w8, s, None, x.dtype), silu))
        r["w8a8_compiled_us"] = time_calls(lambda x, p: compiled(x, p[0], p[1][:, None]), x, pairs)
        r["w8a8_compiled_rel_err"] = rel_err(compiled(x, w8s[0], scales[0][:, None]))
        # the skinny kernel's W8A8 form, FP8 operands on both sides of the MMA: the rows quantized per token by a
        # kernel before it, or by that kernel with one static input_scale (a calibrated checkpoint's)
        r["w8a8_skinny_us"] = time_calls(lambda x, p: launch_linear(x, p[0], silu, scale=p[1], w8a8=True), x, pairs)
        r["w8a8_skinny_rel_err"] = rel_err(launch_linear(x, w8s[0], silu, scale=scales[0], w8a8=True))
        static = (x.float().abs().amax() / FP8_MAX).reshape(())
        r["w8a8_skinny_static_us"] = time_calls(
            lambda x, p: launch_linear(x, p[0], silu, scale=p[1], w8a8=True, input_scale=static), x, pairs)
        if sweep and x.shape[0] <= MAX_ROWS:
            r["w8a8_skinny_configs"] = sweep_configs(
                lambda x, w8, s, cfg: launch_linear(x, w8, silu, scale=s, config=cfg, w8a8=True), x, pairs, deadline,
                lambda y: {"rel_err": rel_err(y)}, silu)
            best(r, "w8a8_skinny", "W8A8 (skinny kernel)")
    # W8A16's sweep after W8A8's (the form FP8 tensor cores run), so a deadline cuts this one
    if sweep and "fp8_us" in r and x.shape[0] <= MAX_ROWS:
        r["fp8_configs"] = sweep_configs(
            lambda x, w8, s, cfg: launch_linear(x, w8, silu, scale=s, config=cfg), x, pairs, deadline,
            lambda y: {"bits_equal_default": torch.equal(y.float(), out)}, silu)
        best(r, "fp8", "W8A16")
    r["dequant_us"] = time_calls(lambda x, fw: fp8_linear_reference(x, fw, silu), x, fws)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time the launch configurations per shape")
    p.add_argument("--batches", type=batch_list, default=[1],
                   help="comma-separated, e.g. 1,8; rows = batch·(γ+1) (batch·γ for the draft's)")
    p.add_argument("--deadline-s", type=float, default=420.0)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the W8A16 kernel on an FP8 copy of each weight (default on)")
    p.add_argument("--sweep-fp8", action="store_true",
                   help="time the skinny kernel's FP8 forms (W8A8, then W8A16) in each launch configuration per shape")
    p.add_argument("--shapes", default=None,
                   help="comma-separated names of shapes() to run (default: all), e.g. qkv,o,gate_up+silu,down")
    p.add_argument("--out-dir", type=Path, default=results.RESULTS, help="where the result goes (the common schema)")
    a = p.parse_args(argv)
    picked = a.shapes.split(",") if a.shapes else None
    unknown = sorted(set(picked or []) - {name for name, *_ in shapes()})
    if unknown:
        p.error(f"--shapes: no shape named {', '.join(unknown)} (the shapes: "
                f"{', '.join(name for name, *_ in shapes())})")
    if not torch.cuda.is_available():
        print("benchmarks/linear.py: needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"shapes": {}, "sequence": {}}
    doc = results.record("linear", {"batches": a.batches, "sweep": a.sweep, "deadline_s": a.deadline_s,
                                    "fp8": a.fp8, "sweep_fp8": a.sweep_fp8, "shapes": a.shapes}, res)

    def save():
        return results.write(doc, a.out_dir)

    # The read stream ceiling: a bf16 sum over 2 GiB (reads only), beside the copy.
    big = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()
    us_sum, _ = time_in_graph([lambda: big.sum(dtype=torch.float32)], reps=4, replays=10)
    res["read_GBps"] = big.numel() * 2 / us_sum / 1e3
    big = None  # free the 2 GiB
    print(f"read stream (torch sum over 2 GiB): {res['read_GBps']:.0f} GB/s", flush=True)

    with torch.inference_mode():
        for b in a.batches:
            for name, m, N, K, silu in shapes():
                if picked and name not in picked:
                    continue
                M = m * b
                key = f"{name}@M{M}"
                x, ws = operands(M, N, K, dev)
                nbytes = N * K * 2
                r = {"M": M, "N": N, "K": K, "silu_mul": silu, "weight_MB": nbytes / 1e6}
                r["cublas_us"] = time_calls(lambda x, w: linear_reference(x, w, silu), x, ws)
                ref = linear_reference(x, ws[0], silu).float()
                cands = configs(M, silu) if (a.sweep and time.time() - t0 < a.deadline_s) else [default_config(M, N // (1 + silu), K, silu)]
                timings = []
                for cfg in cands:
                    if time.time() - t0 > a.deadline_s:
                        break
                    try:
                        out = launch_linear(x, ws[0], silu, config=cfg).float()
                        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                        us = time_calls(lambda x, w, cfg=cfg: launch_linear(x, w, silu, config=cfg), x, ws)
                    except Exception as e:  # noqa: BLE001 — a configuration that does not compile
                        timings.append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:100]}"))
                        continue
                    timings.append(dict(cfg, us=us, rel_err=err))
                ok = [t for t in timings if "us" in t]
                best = min(ok, key=lambda t: t["us"]) if ok else None
                r["configs"] = timings
                r["best"] = best
                if best:
                    r["triton_us"] = best["us"]
                    r["cublas_GBps"] = nbytes / r["cublas_us"] / 1e3
                    r["triton_GBps"] = nbytes / best["us"] / 1e3
                    print(f"{key:>22}: cuBLAS {r['cublas_us']:8.1f} µs ({r['cublas_GBps']:5.0f} GB/s)  triton "
                          f"{best['us']:8.1f} µs ({r['triton_GBps']:5.0f} GB/s) {r['best']}", flush=True)
                if a.fp8 and time.time() - t0 < a.deadline_s:
                    r.update(fp8_figures(x, ws, silu, a.sweep_fp8, t0 + a.deadline_s))
                    if "fp8_us" in r:
                        beyond = "" if r["fp8_in_op_range"] else " (past the op's rows: the engines run W8A8 here)"
                        print(f"{key:>22}: W8A16{beyond} {r['fp8_us']:8.1f} µs ({r['fp8_GBps']:5.0f} GB/s of FP8 "
                              "weights), "
                              f"{r.get('triton_us', float('nan')) / r['fp8_us']:.2f}× the bf16 kernel's speed, "
                              f"rel. error {r['fp8_rel_err']:.2e}", flush=True)
                    if "w8a8_us" in r:
                        print(f"{key:>22}: W8A8 {r['w8a8_us']:8.1f} µs eager, {r['w8a8_compiled_us']:8.1f} compiled "
                              f"({r['cublas_us'] / r['w8a8_compiled_us']:.2f}× bf16 cuBLAS's speed; rel. error "
                              f"{r['w8a8_compiled_rel_err']:.2e}), in the skinny kernel {r['w8a8_skinny_us']:8.1f} µs "
                              f"(rel. error {r['w8a8_skinny_rel_err']:.2e}; with a static scale "
                              f"{r['w8a8_skinny_static_us']:.1f}); dequantize + cuBLAS "
                              f"{r['dequant_us']:8.1f} µs", flush=True)
                res["shapes"][key] = r
                save()
                del ws

        if not picked:  # (a pick of shapes: no whole sequence)
            # The whole GEMM sequence of a step (151 GEMMs), cuBLAS and the engine's through the kernel, each
            # in one graph.
            from presets import gemm_floor, preset_configs, random_pair

            from muse_spark.options import KernelOptions, use_options

            tcfg, dcfg = preset_configs("muse-spark-8b")
            target, draft = random_pair(tcfg, dcfg, dev)
            for b in a.batches:
                seq = res["sequence"][b] = {}
                for label, engine in (("cublas", False), ("engine", True)):
                    with use_options(KernelOptions(linear="triton")):
                        r = gemm_floor(target, draft, b, dcfg.block_size, dev, iters=10, engine=engine)
                    seq[label] = r["median_ms"]
                    print(f"sequence B={b} ({r['gemms']} GEMMs, {r['how']}) {label}: {r['median_ms']:.3f} ms",
                          flush=True)
                seq["weight_GB"] = r["weight_bytes"] / 1e9
                save()
    res["seconds"] = time.time() - t0
    print(f"result: {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
