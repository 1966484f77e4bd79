"""Does an L2 prefetch issued during a latency-bound phase speed up the weight GEMM after it?

    python scripts/prefetch_bench.py [--json out.json]      # on a CUDA device (sm_90 for "bulk")

The batch-1 step alternates weight GEMMs (HBM-bound) with latency-bound kernels (attention,
norms) during which HBM idles. This measures, inside one CUDA graph, per iteration:

    [prefetch kernel: the first P MB of W_i into L2] → [idle phase: torch.cuda._sleep, or nothing]
    → [F.linear(x, W_i)]   (x: 8 rows, bf16)

rotating over enough copies of each weight that every GEMM starts with its weight out of L2.
The prefetch kernel only issues the prefetches (``plugins/triton_math.prefetch_l2``) and exits;
the memory system fills L2 while the idle phase runs. Printed per weight shape, idle phase and
prefetch size: µs per iteration and the saving against no prefetch, side by side in one run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from muse_spark.plugins.markov.bench import time_in_graph
from muse_spark.plugins.triton_math import prefetch_l2

SHAPES = {  # (N, K) of the target's weights at Muse Spark size
    "o": (4096, 4096),
    "qkv": (6144, 4096),
    "down": (4096, 14336),
    "gate_up": (28672, 4096),
}


@triton.jit
def _prefetch_kernel(src_ptr, nbytes, out_ptr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BULK: tl.constexpr):
    z = prefetch_l2(src_ptr, nbytes, tl.program_id(0), tl.num_programs(0), CHUNKS, CHUNK, BULK)
    tl.store(out_ptr + tl.program_id(0), z)


def prefetch(w: torch.Tensor, nbytes: int, out: torch.Tensor, bulk: bool) -> None:
    """bulk: 16 one-warp programs issue 64 KB prefetches; else 132 programs issue one per 128-byte line."""
    chunk, programs, warps = (1 << 16, 16, 1) if bulk else (128, 132, 4)
    nbytes = min(nbytes, w.numel() * w.element_size()) // 16 * 16
    chunks = triton.next_power_of_2(triton.cdiv(triton.cdiv(nbytes, chunk), programs))
    _prefetch_kernel[(programs,)](w, nbytes, out, CHUNKS=chunks, CHUNK=chunk, BULK=bulk, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="o,qkv,down,gate_up")
    ap.add_argument("--idle-us", default="0,4,10")
    ap.add_argument("--mb", default="0,8,16,24,34,48")
    opts = ap.parse_args()
    dev = torch.device("cuda")
    cycles_per_us = torch.cuda.get_device_properties(dev).clock_rate / 1000 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1980.0
    out = torch.zeros(1024, dtype=torch.int32, device=dev)
    results = []
    for name in opts.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(3, (600 << 20) // (n * k * 2))  # > 10x the L2 between two uses of one copy
        ws = [torch.randn(n, k, device=dev).bfloat16() for _ in range(copies)]
        x = torch.randn(8, k, device=dev).bfloat16()
        wbytes = n * k * 2
        for idle in [float(s) for s in opts.idle_us.split(",")]:
            cycles = int(idle * cycles_per_us)
            base = None
            if cycles:
                alone, _ = time_in_graph([lambda: torch.cuda._sleep(cycles)], reps=32)
                print(f"idle phase alone: {alone:.2f} us (asked {idle} us)", flush=True)
                results.append(dict(shape="idle only", idle_us=idle, us=round(alone, 2)))
            for mb in [float(s) for s in opts.mb.split(",")]:
                nbytes = int(mb * (1 << 20))
                if nbytes > wbytes + (1 << 20):
                    continue
                for bulk in ((True, False) if nbytes else (True,)):
                    def step(i, nbytes=nbytes, bulk=bulk):
                        if nbytes:
                            prefetch(ws[i], nbytes, out, bulk)
                        if cycles:
                            torch.cuda._sleep(cycles)
                        torch.nn.functional.linear(x, ws[i])

                    calls = [lambda i=i: step(i) for i in range(copies)]
                    us, how = time_in_graph(calls, reps=2 * copies)
                    if nbytes == 0:
                        base = us
                    row = dict(shape=name, weight_mb=round(wbytes / 2**20, 1), idle_us=idle, prefetch_mb=mb,
                               bulk=bulk, us=round(us, 2), saved_us=round(base - us, 2) if base else 0.0, how=how)
                    results.append(row)
                    print(f"{name:8} W {row['weight_mb']:6.1f} MB  idle {idle:4.1f} us  prefetch {mb:5.1f} MB "
                          f"{'bulk' if bulk else 'line':4}  {us:8.2f} us/iter  saved {row['saved_us']:6.2f} us",
                          flush=True)
        del ws
        torch.cuda.empty_cache()
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
