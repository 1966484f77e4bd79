#!/usr/bin/env python3
"""Diagnose the fused Markov kernel on a GPU: shapes x launch configurations, each against the reference.

    python scripts/markov_diag.py [--spin-limit 65536] [--calls 3] [--probs] [--poison] [--same-seed]

For every case (batch, γ, draft vocab, target vocab, rank) and launch configuration it runs
``launch_markov_sample(check=True)`` on exact-arithmetic inputs (``make_inputs(exact=True)``:
the Markov bias is exact in any summation order, so sampled tokens must equal the reference's
bit for bit), and prints one line: ``ok``, the rows whose tokens differ (with the first
differing step's keys), or the step words that were never written when a program gave up polling. It
is how the batch-16 defect (docs/benchmarks.md, "The Markov kernel defect") was narrowed down;
a small ``--spin-limit`` makes a lost word cost milliseconds instead of a minute.

``--probs`` also compares the draft probabilities with the reference's (the tests' tolerance),
and ``--poison`` fills the kernel's softmax partials and probability buffer with NaN before each
call: the tenth session saw, once, ids equal to the reference's with 2499 of 15000 probabilities
off at B=3, Vd=1000 under ``1-request-blocks`` (docs/benchmarks.md), which points at a partial
read before it was written; poisoned, such a read shows as NaN instead of the last call's value.
Not in the probabilities, though (found in the twenty-fourth session): the merge drops a NaN
max (max() returns the other operand, and the where() on ``ms > -inf`` drops its sum), so a
slice's partials read too early make that row's probabilities wrong but finite, which is what
the twentieth session saw. So with ``--poison`` the kernel also checks every partial and step
word its final phase reads, and a read before the write raises (error flag 3), shown here as
that seed's verdict.
"""

from __future__ import annotations

import argparse
import time

import torch

CASES = [  # (B, gamma, Vd, V, r)
    (8, 7, 4096, 8192, 64), (9, 7, 4096, 8192, 64), (12, 7, 4096, 8192, 64), (13, 7, 4096, 8192, 64),
    (16, 7, 4096, 8192, 64), (16, 7, 32768, 131072, 256), (32, 7, 32768, 131072, 256),
    (3, 5, 1000, 3001, 24), (1, 7, 32768, 131072, 256),  # the tenth session's failure; the batch-1 default
]
CONFIGS = {  # name -> (config overrides, fp32 weights)
    "default": ({}, False),
    "one-launch-per-step": ({"GRID_SYNC": False}, False),
    "4-warps": ({"num_warps": 4}, False),
    "16-warps": ({"num_warps": 16}, False),
    "128-columns": ({"BLOCK_V": 128}, False),
    "512-columns": ({"BLOCK_V": 512}, False),
    "fp32-weights": ({}, True),
    "1-request-blocks": ({"BLOCK_B": 1, "BLOCK_V": 128, "RESIDENT": False}, False),
}


def inputs(B, gamma, Vd, V, r, seed, device):
    """Exact-arithmetic inputs (plugins/markov/bench.make_inputs), greedy and sampled rows mixed."""
    from muse_spark.plugins.markov.bench import make_inputs

    args = make_inputs(B, gamma, Vd, r, V, device=device, seed=seed, exact=True)[0]
    args[8] = torch.tensor([0.3, 0.0, 0.8, 1.2], device=device)[torch.arange(B, device=device) % 4]
    return args


def first_difference(args, ids, ref_ids) -> str:
    """The first differing (row, step) and the reference's keys there."""
    from muse_spark.plugins.keyed_random import SALT_DRAFT, keyed_gumbel

    U, _h, anchor, w1, w2, d2t, seeds, pos, temps = args[:9]
    row, k = (ids != ref_ids).nonzero()[0].tolist()
    prev = anchor[row] if k == 0 else ref_ids[row, k - 1]
    z = U[row, k].float() + w2.float() @ w1[prev].float()
    t = float(temps[row])
    key = z if t == 0 else z * (1.0 / t) + keyed_gumbel(seeds[row:row + 1], pos[row:row + 1] + k + 1,
                                                          SALT_DRAFT, z.shape[0])[0]
    top = key.topk(2)
    picked = ((torch.arange(z.shape[0], device=z.device) + d2t) == ids[row, k]).nonzero().flatten().tolist()
    return (f"first at request {row} step {k} (T={t}): kernel {int(ids[row, k])} (key "
            f"{[round(key[i].item(), 6) for i in picked]}), reference {int(ref_ids[row, k])} (top keys "
            f"{[round(v, 6) for v in top.values.tolist()]})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spin-limit", type=int, default=1 << 16)
    p.add_argument("--calls", type=int, default=3, help="seeds per case and configuration")
    p.add_argument("--cases", default=None, help="indices into CASES, comma-separated (default: all)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--probs", action="store_true", help="compare the probabilities too (the tests' tolerance)")
    p.add_argument("--poison", action="store_true", help="NaN in the partials and probabilities before each call")
    p.add_argument("--same-seed", action="store_true",
                   help="every call on the first seed's inputs: a fault that comes and goes is a race, not the inputs")
    a = p.parse_args()
    from muse_spark.plugins.markov.reference import markov_sample_ref
    from muse_spark.plugins.markov.triton_kernel import launch_markov_sample

    cuda = torch.cuda.is_available()  # else Triton's CPU interpreter (TRITON_INTERPRET=1), slowly
    dev = torch.device("cuda" if cuda else "cpu")
    print(f"{torch.cuda.get_device_name(dev) if cuda else 'CPU interpreter'}, torch {torch.__version__}", flush=True)
    cases = CASES if a.cases is None else [CASES[int(i)] for i in a.cases.split(",")]
    for case in cases:
        for name in a.configs.split(","):
            over, fp32 = CONFIGS[name]
            t0, verdicts = time.perf_counter(), []
            for c in range(a.calls):
                args = inputs(*case, seed=100 + (0 if a.same_seed else c), device=dev)
                ref_ids, ref_probs = markov_sample_ref(*args)
                if fp32:
                    args[3], args[4] = args[3].float(), args[4].float()
                try:
                    ids, probs = launch_markov_sample(args[0], *args[2:9], config=over or None, check=True,
                                                      spin_limit=a.spin_limit, interpret=not cuda, poison=a.poison)
                except Exception as e:  # the error flag (RuntimeError), or a configuration that does not fit
                    verdicts.append(f"seed {c}: {type(e).__name__}: {e}")
                    continue
                bad = (ids != ref_ids).any(-1)
                if bad.any():
                    verdicts.append(f"seed {c}: {int(bad.sum())} of {case[0]} rows differ; "
                                    + first_difference(args, ids, ref_ids))
                elif a.probs:
                    off = ~torch.isclose(probs, ref_probs, rtol=1e-5, atol=1e-6)  # tests/tolerances.py "probs"
                    if off.any():
                        rows = off.any(-1).nonzero().tolist()
                        verdicts.append(f"seed {c}: ids equal, {int(off.sum())} probabilities off (NaN: "
                                        f"{int(probs.isnan().sum())}) in (request, step) {rows[:8]}")
            dt = time.perf_counter() - t0
            print(f"B={case[0]} γ={case[1]} Vd={case[2]} V={case[3]} r={case[4]} {name:>20}: "
                  + ("ok" if not verdicts else " | ".join(verdicts)) + f"  ({dt:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
