"""The speculative step and generation split across ranks: step time, all-reduce time and tokens/s at
each tensor-parallel size, against each size's bandwidth roofline.

    python benchmarks/tensor_parallel.py --pair DIR [--tp 1,2,4,8] [--batches 1,8,32] [--context 256]
        [--max-tokens 128] [--device cuda|cpu] [--backend eager|aoti --work-dir DIR [--reuse-engine]]
        [--out-dir benchmarks/results]

For each tensor-parallel size N (ranks as processes: NCCL, one GPU a rank, on CUDA; gloo on CPU) and
batch size B, on the eager engine split as ``runtime/tensor_parallel.py`` splits it (``--backend aoti``: an
aoti engine built for N ranks, ``build --backend aoti --tp N``, in ``--work-dir``/tp{N}; at N = 1 the
plain aoti engine, run on one rank through the same leader):

* the step: B requests with ``--context`` tokens of prompt each, the step run ``--iters`` times at the
  same position (the device synchronized around each; median ms), on rank 0's ``LeaderEngine`` so the
  other ranks run the same step;
* the all-reduce: the step's collectives alone (2 per target layer, [B·(γ+1), hidden] FP32 each),
  timed the same way;
* the roofline: the bytes a rank must read a step (its weight slice — the target's per-rank share of
  the split matrices plus the replicated embedding, lm_head and draft — and its KV) over the copy
  bandwidth measured on rank 0's device, so N ranks' roofline is about 1/N of one's for the split part;
* generation: ``Generator.generate`` of B prompts × ``--max-tokens`` tokens (greedy), tokens/s.

The result goes to ``benchmarks/results/`` in the common schema (benchmark ``tensor-parallel``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)
from timing import batch_list, copy_bandwidth  # noqa: E402


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_bytes(engine, batch: int, context: int) -> int:
    """Bytes one rank reads a step: every weight it holds once (the embedding only where gathered and
    the draft's Markov W1 only per token) and the valid KV of its caches."""
    import torch

    skip = {"model.embed_tokens.weight", "model.markov_head.markov_w1.weight"}
    w = 0
    for module in (engine.target, engine.draft):
        for name, p in module.state_dict().items():
            if name not in skip and isinstance(p, torch.Tensor):
                w += p.numel() * p.element_size()
    t, d = engine.tcfg, engine.dcfg
    kv = 2 * batch * context * t.head_dim * 2 * (t.num_hidden_layers * t.num_key_value_heads
                                                 + d.num_hidden_layers * d.num_key_value_heads)
    return w + kv


def _lead(leader, batches: list[int], context: int, iters: int, max_tokens: int, world: int) -> dict:
    """Rank 0: the step, the all-reduces alone and generation at each batch size."""
    import torch

    from muse_spark.builder.pair import random_prompts
    from muse_spark.runtime.calibrate import median_ms
    from muse_spark.runtime.generator import Generator, SamplingParams

    eng, dev, g = leader, leader.device, leader.gamma
    ids = (leader.draft.d2t + torch.arange(len(leader.draft.d2t), device=leader.draft.d2t.device)).tolist()
    bw = copy_bandwidth(dev, gib=1.0 if dev.type == "cuda" else 0.125)["GBps"]
    out = {"copy_GBps": bw, "batches": {}}
    for B in batches:
        prompts = random_prompts(ids, B, context, seed=B)
        for slot, p in enumerate(prompts):
            eng.prefill(p, slot, slot, 0.0)
        args = ([p[-1] for p in prompts], [context] * B, list(range(B)), list(range(B)), [0.0] * B)
        step_ms = median_ms(lambda: eng.step_host(*args, context + g + 1), dev, iters)
        # the step's collectives alone (none at one rank)
        reduce_ms = leader.time_collectives(B * (g + 1), iters) if world > 1 else 0.0
        reqs = Generator(leader).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        _sync(dev)
        t0 = time.perf_counter()
        reqs = Generator(leader).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        _sync(dev)
        secs = time.perf_counter() - t0
        nbytes = rank_bytes(leader, B, context)
        out["batches"][str(B)] = {
            "step_ms": round(step_ms, 4), "allreduce_ms": round(reduce_ms, 4), "rank_bytes": nbytes,
            "roofline_ms": round(nbytes / bw / 1e6, 4), "step_over_roofline": round(step_ms / (nbytes / bw / 1e6), 3),
            "tokens_per_s": round(sum(len(r.output) for r in reqs) / secs, 2),
            "mean_accepted_per_step": round(sum(s.accepted for r in reqs for s in r.steps)
                                            / max(1, sum(len(r.steps) for r in reqs)), 3),
            "chained_steps": bool(leader.chains),
        }
    return out


def aoti_engine(a, world: int, max_batch: int, max_seq: int) -> Path:
    """The aoti engine of the pair for ``world`` ranks in ``a.work_dir``/tp{world} (built unless
    ``--reuse-engine`` finds one), its batch buckets the benchmark's batch sizes."""
    from muse_spark.builder.build import build_engine

    out = Path(a.work_dir) / f"tp{world}"
    if a.reuse_engine and (out / "manifest.json").is_file():
        return out
    print(f"[tensor-parallel] tp {world}: building {out}", flush=True)
    build_engine(Path(a.pair) / "target", Path(a.pair) / "draft", out, backend="aoti", device=a.device,
                 max_batch=max_batch, max_seq=max_seq, tp=world, buckets=sorted(a.batches), quiet=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", required=True, help="a make-pair folder (target/, draft/)")
    p.add_argument("--tp", type=batch_list, default=[1, 2], help="comma-separated tensor-parallel sizes")
    p.add_argument("--batches", type=batch_list, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where available")
    p.add_argument("--backend", choices=["eager", "aoti"], default="eager",
                   help="eager: the pair split at load; aoti: an engine compiled for each size")
    p.add_argument("--work-dir", default=None, help="(--backend aoti) where the engines are built, tp{N} each")
    p.add_argument("--reuse-engine", action="store_true", help="(--backend aoti) keep an engine already built there")
    p.add_argument("--out-dir", default=str(results.RESULTS))
    a = p.parse_args(argv)
    import torch

    from muse_spark.runtime import tensor_parallel as tp

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.backend == "aoti" and not a.work_dir:
        p.error("--backend aoti builds its engines in --work-dir")
    max_batch, max_seq = max(a.batches), a.context + a.max_tokens + 64
    runs = {}
    for world in a.tp:
        lead = functools.partial(_lead, batches=sorted(a.batches), context=a.context, iters=a.iters,
                                 max_tokens=a.max_tokens, world=world)
        if a.backend == "aoti":
            engine = aoti_engine(a, world, max_batch, max_seq)
            print(f"[tensor-parallel] tp {world}: ranks loading {engine}", flush=True)
            r = tp.launch(world, tp.lead_or_follow, str(engine), None, lead, a.device, device=a.device)
        else:
            print(f"[tensor-parallel] tp {world}: ranks loading", flush=True)
            r = tp.launch(world, tp.lead_or_follow, str(Path(a.pair) / "target"), str(Path(a.pair) / "draft"), lead,
                          a.device, max_batch, max_seq, device=a.device)
        runs[str(world)] = r
        for b, row in r["batches"].items():
            print(f"  tp {world} B={b}: step {row['step_ms']:.3f} ms ({row['step_over_roofline']:.2f}× its roofline "
                  f"{row['roofline_ms']:.3f} ms), all-reduces {row['allreduce_ms']:.3f} ms, "
                  f"{row['tokens_per_s']:.1f} tok/s, {row['mean_accepted_per_step']:.2f} accepted/step", flush=True)
    doc = results.record("tensor-parallel", {k: v for k, v in vars(a).items() if k != "out_dir"}, {"tp": runs})
    print(f"[tensor-parallel] wrote {results.write(doc, Path(a.out_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
