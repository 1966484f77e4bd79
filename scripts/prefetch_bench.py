"""Does an L2 prefetch issued during a latency-bound phase speed up the weight GEMM after it?

    python scripts/prefetch_bench.py [--json out.json]      # on a CUDA device (sm_90 for "bulk")

The batch-1 step alternates weight GEMMs (HBM-bound) with latency-bound kernels (attention,
norms) during which HBM idles. This measures, inside one CUDA graph, per iteration:

    [prefetch kernel: the first P MB of W_i into L2] → [idle phase: torch.cuda._sleep, or nothing]
    → [F.linear(x, W_i)]   (x: 8 rows, bf16)

rotating over enough copies of each weight that every GEMM starts with its weight out of L2.
The prefetch kernel only issues the prefetches (``prefetch_l2`` below) and exits;
the memory system fills L2 while the idle phase runs. Printed per weight shape, idle phase and
prefetch size: µs per iteration and the saving against no prefetch, side by side in one run.

Measured on the H200 (2026-12-03, docs/prefetch-bench.json): every prefetch made the sequence
slower, by about the time to stream the prefetched bytes, whatever the idle phase; the GEMM after
it did not get faster. So no plugin kernel prefetches (docs/benchmarks.md, sixth session).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from muse_spark.plugins.markov.bench import time_in_graph

SHAPES = {  # (N, K) of the target's weights at Muse Spark size
    "o": (4096, 4096),
    "qkv": (6144, 4096),
    "down": (4096, 14336),
    "gate_up": (28672, 4096),
}


# Fire-and-forget prefetches into L2. The asm is one line and pure, as a plugin kernel would need
# it (Inductor re-emits a user kernel's source, where "\n" broke a string literal before; torch's
# mutation analysis of a user Triton kernel skips pure inline asm and refuses impure). A pure op's
# result must be used, or the compiler drops it: hence the returned zero.
@triton.jit
def prefetch_l2(base_ptr, nbytes, part, parts, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BULK: tl.constexpr):
    """Prefetch bytes [0, nbytes) at ``base_ptr`` into L2: program ``part`` of ``parts`` takes chunks
    part, part + parts, … (``CHUNKS`` of ``CHUNK`` bytes each; CHUNKS·parts·CHUNK ≥ nbytes). ``BULK``:
    one ``cp.async.bulk.prefetch.L2`` per chunk (sm_90; nbytes and CHUNK multiples of 16); else one
    ``prefetch.global.L2::evict_last`` per 128-byte line (CHUNK = 128). → an int32 zero to store."""
    i = tl.arange(0, CHUNKS).to(tl.int64)
    off = (part + parts * i) * CHUNK
    valid = off < nbytes
    off = tl.where(valid, off, 0)
    ptrs = base_ptr.to(tl.pointer_type(tl.int8)) + off
    if BULK:
        size = tl.where(valid, tl.minimum(nbytes - off, CHUNK), 16).to(tl.int32)
        z = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [ptrs, size], dtype=tl.int32, is_pure=True, pack=1)
    else:
        z = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [ptrs], dtype=tl.int32, is_pure=True, pack=1)
    return tl.sum(z, axis=0)


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
        ws.clear()  # free the copies before the next shape
        torch.cuda.empty_cache()
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
