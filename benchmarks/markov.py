"""Micro-benchmark: the fused Markov loop (Triton) against the reference loop, on a CUDA device.

    python benchmarks/markov.py [--workspace | --variants | --compile-only] [--out-dir benchmarks/results]

Times are per call, in µs, measured as the loop runs in an engine: inside a
CUDA graph (``graph=True``), with ``reps`` calls captured back to back in one
graph so that replay launch costs are amortized and the kernel-to-kernel gaps
inside the graph are counted. Sampling at temperature 1 (the heavier path).

* ``warm``: the same weights every call, so W2 (16 MB) stays in the 60 MB L2.
* ``cold``: the captured calls rotate over 8 weight sets (8 × 80 MB), so each
  call starts with W2 out of L2, as after a target forward pass.

The floor: at batch 1, γ = 7, Vd = 32768, r = 256 the loop reads W2 once from
HBM (16 MB / 4.3 TB/s ≈ 3.9 µs) and each step is a chain of dependent
accesses (poll the step words → W1 row → GEMV → step word), so it is
latency-bound: the target is ≤ 30 µs.

Measured on the H200 (torch 2.11, Triton 3.6; sampled, T = 1; warm / cold L2), the
defaults of 2026-12-03 with a kept workspace (``--variants``, three alternating runs):
batch 1: 27.5–27.6 / 30.1–30.4 µs (W2 slice in shared memory, tensor-core GEMV,
counting barrier, one reduction per poll); batch 8: 98.1–98.3 / 100.7–100.9 µs.
Earlier defaults: batch 1: 30.8 / 33.3 µs (W2 in registers, 8 warps; 41.6 / 51.3 reading W2 from
L2 each step); batch 8: 97.7 / 100.4 µs; batch 32: 173 / 174 µs. The reference
loop, eager (it could not be captured then: ``sanitize_logits`` copied a host scalar, fixed since):
6.8–8.2 ms. At batch 1: γ = 1 costs 11.6 µs, rank 0 (no GEMV) 17.0 µs, greedy
the same as sampled. (Measured with an L2 prefetch of the next W1 row, since
removed: it changed nothing beyond ±1 µs and inductor cannot analyse inline asm.)

The figures go to ``benchmarks/results/`` in the common schema (``benchmarks/results.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from muse_spark.plugins.markov.reference import markov_sample_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from timing import time_in_graph  # noqa: E402


def make_inputs(batch: int, gamma: int, vd: int, rank: int, vocab: int, device="cuda", seed=0, temperature=1.0,
                weight_sets: int = 1, exact: bool = False) -> list[list]:
    """``weight_sets`` argument lists sharing logits/seeds, each with its own W1/W2. ``exact``: weights
    in {-2..2}·2^-3, so the Markov bias is exact in fp32 in any summation order and sampled tokens
    must equal the reference's bit for bit."""
    g = torch.Generator(device=device).manual_seed(seed)
    U = 2 * torch.randn(batch, gamma, vd, device=device, generator=g)
    h = torch.randn(batch, gamma, 64, device=device, generator=g)
    d2t = torch.sort(torch.randperm(vocab, device=device, generator=g)[:vd]).values - torch.arange(vd, device=device)
    anchor = torch.randint(0, vocab, (batch,), device=device, generator=g)
    seeds = torch.randint(0, 2**62, (batch,), device=device, generator=g)
    pos = torch.randint(0, 100_000, (batch,), device=device, generator=g)
    temp = torch.full((batch,), float(temperature), device=device)
    sets = []
    for _ in range(weight_sets):
        if exact:
            w1 = (torch.randint(-2, 3, (vocab, rank), device=device, generator=g) * 2**-3).bfloat16()
            w2 = (torch.randint(-2, 3, (vd, rank), device=device, generator=g) * 2**-3).bfloat16()
        else:
            w1 = (0.5 * torch.randn(vocab, rank, device=device, generator=g)).bfloat16()
            w2 = (0.2 * torch.randn(vd, rank, device=device, generator=g)).bfloat16()
        sets.append([U, h, anchor, w1, w2, d2t, seeds, pos, temp, "vanilla", None, None, 0])
    return sets


def _op(impl: str, config: dict | None):
    """The loop as a function of ``make_inputs``'s arguments. ``config``: launch configuration, and
    ``KEEP_WORKSPACE=True`` to keep one workspace across calls (as an engine's bucket does: no
    memset per call) instead of a zeroed one per call."""
    if impl == "reference":
        return markov_sample_ref
    from muse_spark.plugins.markov.triton_kernel import launch_markov_sample, workspace_words

    config = dict(config or {})
    keep = config.pop("KEEP_WORKSPACE", False)
    kept = {}

    def run(U, h, anchor, w1, w2, d2t, seeds, pos, temp, *_):
        ws = None
        if keep:
            key = tuple(U.shape)
            if key not in kept:
                n = workspace_words(U.shape[0], U.shape[1], U.shape[2], w1.shape[1], U.device, w1.dtype, config)
                kept[key] = torch.zeros(n, dtype=torch.int64, device=U.device)
            ws = kept[key]
        return launch_markov_sample(U, anchor, w1, w2, d2t, seeds, pos, temp, config=config or None, workspace=ws)

    return run


def bench_markov(batch: int, gamma: int = 7, vd: int = 32768, rank: int = 256, vocab: int = 131072,
                 impl: str = "triton", config: dict | None = None, cold: bool = False, reps: int = 16) -> float:
    """Median µs per Markov-loop call (CUDA graph, sampling at T = 1)."""
    us, _ = bench_markov_detail(batch, gamma, vd, rank, vocab, impl, config, cold, reps)
    return us


def bench_markov_detail(batch, gamma=7, vd=32768, rank=256, vocab=131072, impl="triton", config=None, cold=False,
                        reps=16) -> tuple[float, str]:
    sets = make_inputs(batch, gamma, vd, rank, vocab, weight_sets=8 if cold else 1)
    op = _op(impl, config)
    calls = [lambda a=a: op(*a) for a in sets]
    if impl == "reference":
        # Timed eagerly: sanitize_logits builds tensors from Python scalars (a host copy), which a
        # CUDA-graph capture refuses, and a failed capture can leave the context unusable.
        return time_in_graph(calls, reps=4, graph=False)
    return time_in_graph(calls, reps=reps)


def check_config(batch: int, config: dict | None, gamma=7, vd=32768, rank=256, vocab=131072) -> str:
    """Greedy and sampled ids of a configuration against the reference (random bf16 weights)."""
    out = []
    for temperature in (0.0, 1.0):
        args = make_inputs(batch, gamma, vd, rank, vocab, seed=3, temperature=temperature)[0]
        ids, probs = _op("triton", config)(*args)
        ref_ids, ref_probs = markov_sample_ref(*args)
        rows = int((ids != ref_ids).any(-1).sum())
        err = (probs - ref_probs).abs().max().item()
        out.append(f"T={temperature:g}: {rows}/{batch} rows differ, |Δq|max {err:.1e}")
    return "; ".join(out)


SWEEP = {  # configurations compared on the H200 (partial dicts over default_config)
    1: [None,
        dict(KEEP_WORKSPACE=True),
        dict(KEEP_WORKSPACE=True, COUNT_BARRIER=True),
        dict(RESIDENT=True, num_warps=16),
        dict(RESIDENT=False, num_warps=8),
        dict(BLOCK_V=128, RESIDENT=False, GRID_SYNC=False, num_warps=8)],
    8: [None,
        dict(KEEP_WORKSPACE=True),
        dict(BLOCK_V=512),
        dict(GRID_SYNC=False)],
    32: [None,
         dict(BLOCK_B=32, BLOCK_V=256),
         dict(BLOCK_V=256, GRID_SYNC=False)],
}


def compile_all() -> None:
    """Run every swept configuration once (fills Triton's on-disk cache; run it beside other work)."""
    for batch, cfgs in SWEEP.items():
        args = make_inputs(batch, 7, 32768, 256, 131072)[0]
        for cfg in cfgs:
            try:
                _op("triton", cfg)(*args)
            except Exception as e:  # noqa: BLE001
                print(f"compile batch {batch} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    _op("triton", None)(*make_inputs(1, 1, 32768, 256, 131072)[0])
    _op("triton", None)(*make_inputs(1, 7, 32768, 0, 131072)[0])
    torch.cuda.synchronize()


WORKSPACE_VARIANTS = [None, {"KEEP_WORKSPACE": True}, {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True}]
KERNEL_VARIANTS = {  # batch 1: W2 resident; kept workspace, as the engines call it
    1: [{"KEEP_WORKSPACE": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True, "POLL_MAX": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True, "MMA": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True, "POLL_MAX": True, "MMA": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True, "POLL_MAX": True, "MMA": True, "num_warps": 4}],
    8: [{"KEEP_WORKSPACE": True},
        {"KEEP_WORKSPACE": True, "COUNT_BARRIER": True, "POLL_MAX": True}],
}


def _name(cfg: dict | None) -> str:
    return "zeroed per call" if cfg is None else ", ".join(k.lower() if v is True else f"{k}={v}" for k, v in cfg.items())


def compare(variants: dict, reps: int = 3) -> dict:
    """Launch variants {batch: [config, …]} timed alternately, ``reps`` times (warm and cold L2),
    each checked once against the reference. ``WORKSPACE_VARIANTS``: a zeroed workspace per call (a
    memset before each kernel) against one kept across calls, as an engine's bucket keeps it."""
    out: dict = {}
    for batch, cfgs in variants.items():
        for cfg in cfgs:
            check = check_config(batch, cfg)
            out.setdefault(str(batch), {})[_name(cfg)] = {"config": cfg, "check": check, "warm_us": [], "cold_us": []}
            print(f"check batch {batch} {cfg}: {check}", flush=True)
    for rep in range(reps):
        for batch, cfgs in variants.items():
            for cfg in cfgs:
                warm, cold = bench_markov(batch, config=cfg), bench_markov(batch, config=cfg, cold=True)
                row = out[str(batch)][_name(cfg)]
                row["warm_us"].append(warm)
                row["cold_us"].append(cold)
                print(f"rep {rep} batch {batch} {_name(cfg)}: warm {warm:.1f} us, cold {cold:.1f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="only compile the swept configurations")
    ap.add_argument("--workspace", action="store_true", help="only compare a kept workspace with a zeroed one")
    ap.add_argument("--variants", action="store_true", help="only compare the kernel variants (KERNEL_VARIANTS)")
    ap.add_argument("--out-dir", default=str(results.RESULTS), help="where the result goes (the common schema)")
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/markov.py needs a CUDA device")
    if opts.compile_only:
        compile_all()
        return 0
    mode = "workspace" if opts.workspace else "variants" if opts.variants else "sweep"
    config = {"mode": mode, "gamma": 7, "draft_vocab": 32768, "rank": 256, "vocab": 131072, "temperature": 1.0,
              "calls_per_replay": 16}
    if mode != "sweep":
        res = {"compare": compare({1: WORKSPACE_VARIANTS, 8: WORKSPACE_VARIANTS} if opts.workspace else KERNEL_VARIANTS)}
        print(f"result: {results.write(results.record('markov', config, res), Path(opts.out_dir))}")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, res = [], {"sweep": {}}
    for batch in (1, 8, 32):
        ref, how = bench_markov_detail(batch, impl="reference")
        res["sweep"][str(batch)] = {"reference_us": ref, "reference_how": how}
        for cfg in SWEEP[batch]:
            name = "default" if cfg is None else ",".join(f"{k}={v}" for k, v in cfg.items())
            try:
                warm = bench_markov(batch, config=cfg)
                cold = bench_markov(batch, config=cfg, cold=True)
                check = check_config(batch, cfg)
            except Exception as e:  # noqa: BLE001 — a failing variant must not hide the others
                res["sweep"][str(batch)][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"batch {batch} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            rows.append((batch, name, warm, cold, ref, how))
            res["sweep"][str(batch)][name] = {"warm_us": warm, "cold_us": cold, "check": check}
            print(f"batch {batch:>2} {name:<46} warm {warm:8.1f} us  cold {cold:8.1f} us  | {check}", flush=True)
    res["batch1_gamma1_us"] = g1 = bench_markov(1, gamma=1)
    print(f"batch  1 default gamma=1: {g1:.1f} us (per-step cost ~ (gamma7 - gamma1)/6)")
    res["batch1_rank0_us"] = r0 = bench_markov(1, rank=0)
    print(f"batch  1 default rank=0 (no Markov GEMV): {r0:.1f} us")
    greedy = time_in_graph([lambda a=make_inputs(1, 7, 32768, 256, 131072, temperature=0.0)[0]: _op("triton", None)(*a)],
                           reps=16)[0]
    res["batch1_greedy_us"] = greedy
    print(f"batch  1 default greedy: {greedy:.1f} us")
    print("\nbatch  config                                          triton warm  triton cold  reference")
    for batch, name, warm, cold, ref, how in rows:
        print(f"{batch:>5}  {name:<46} {warm:11.1f} {cold:12.1f} {ref:10.1f} ({how})")
    print(f"result: {results.write(results.record('markov', config, res), Path(opts.out_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
