"""Timing and roofline helpers shared by the benchmarks in this folder.

* ``time_fn``: median / min milliseconds of a call by CUDA events (wall clock on CPU), warm-up first;
* ``time_in_graph``: µs per call of closures captured back to back in one CUDA graph and timed by
  its replays (as a step graph runs them: the graph's own launch amortized);
* ``host_issue_us``: the host's time to issue a call, the device idle at the call;
* ``profile_kernels`` / ``device_gaps`` / ``slower_in_graph``: where a call's device time goes;
* ``copy_bandwidth`` / ``step_bytes`` / ``roofline_ms``: the roofline, the fewest bytes a speculative step
  reads over a device-to-device copy bandwidth measured in the run (bytes read + written);
* ``host_description``: the machine the host code ran on; ``batch_list``: the ``--batches`` parser.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

def time_fn(fn, device, iters: int, warmup: int = 3) -> dict:
    """Median / min milliseconds of ``fn()`` by CUDA events (wall clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def host_description(device_type: str = "cpu") -> dict:
    """Facts about the machine the run's host code ran on, to group runs by: the kernel release
    (a sandbox's own kernel reports itself here: gVisor gives 4.4.0), the CPU model, the cores this
    process may run on and the NUMA nodes; on CUDA, the driver version. The host's time to issue a
    step differed by up to 6x between machine starts of the same kind (docs/log.md)."""
    import platform

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None

    cpuinfo = read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.lower().startswith("model name")), platform.processor() or None)
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    host = {"kernel": platform.release(), "machine": platform.machine(), "cpu_model": model,
            "cpus": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "numa_nodes": {n.name: (read(str(n / "cpulist")) or "").strip() for n in nodes}}
    if device_type == "cuda":
        import subprocess

        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            host["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            host["driver"] = None
    return host


def host_issue_us(fn, device, iters: int, warmup: int = 3) -> float:
    """Median microseconds the host spends in ``fn()`` before it returns (the device's work it
    issued not awaited; synchronized between calls, so each starts on an idle device)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def profile_kernels(fn, device, calls: int = 3, top: int = 15, keep_all: bool = False) -> dict:
    """Where a call's device time goes: torch.profiler over ``calls`` calls of ``fn`` -> the kernel
    time per call and the ``top`` kernels (name, launches per call, ms per call, share);
    ``keep_all``: also ``all``, {name: ms per call} of every kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    per: dict[str, list] = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and e.cpu_children:  # CPU: leaf operators only, so nothing is counted twice
            continue
        us = e.device_time if cuda else e.cpu_time
        acc = per.setdefault(e.name, [0, 0.0])
        acc[0] += 1
        acc[1] += us
    total = sum(v[1] for v in per.values()) / calls / 1e3
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    out = {"kernel_ms": total, "calls": calls,
           "top": [{"name": k[:120], "launches": v[0] / calls, "ms": v[1] / calls / 1e3,
                    "share": v[1] / calls / 1e3 / total if total else 0.0} for k, v in rows]}
    if keep_all:
        out["all"] = {k[:120]: [v[0] / calls, v[1] / calls / 1e3] for k, v in per.items()}
    if cuda:
        out.update(device_gaps([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA], calls, top))
    return out


def device_gaps(spans: list, calls: int, top: int = 15) -> dict:
    """Where the device sits idle between kernels: ``spans`` ([name, start us, end us] of every
    device event of ``calls`` back-to-back calls) -> ``idle_ms``, the time between one event's end
    and the next one's start summed, per call (the holes between two calls are in it: a step
    replayed back to back pays them too), and ``gaps``: the ``top`` (previous event, next event)
    pairs by their idle ms per call, with how often the pair occurs per call."""
    spans = sorted(spans, key=lambda s: s[1])
    pairs: dict[tuple, list] = {}
    for (pn, _, pe), (nn, ns, _) in zip(spans, spans[1:]):
        acc = pairs.setdefault((pn[:60], nn[:60]), [0, 0.0])
        acc[0] += 1
        acc[1] += max(ns - pe, 0.0)
    idle = sum(v[1] for v in pairs.values()) / calls / 1e3
    rows = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {"idle_ms": idle, "gaps": [{"after": a, "before": b, "count": v[0] / calls, "ms": v[1] / calls / 1e3}
                                      for (a, b), v in rows]}


def slower_in_graph(plain: dict, replay: dict, top: int = 10) -> list:
    """The kernels whose time per step grew most from the packages' plain calls to the graph's
    replay (``profile_kernels(keep_all=True)`` of each): [name, launches, plain ms, replay ms]."""
    rows = [[k, launches, plain["all"].get(k, [0, 0.0])[1], ms] for k, (launches, ms) in replay["all"].items()]
    return sorted(rows, key=lambda r: r[2] - r[3])[:top]


def copy_buffers(device, gib: float = 2.0) -> tuple:
    """The roofline copy's source (``gib`` GiB of fp32) and destination."""
    import torch

    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device).normal_()
    return src, torch.empty_like(src)


def copy_bandwidth(device, gib: float = 2.0, buffers: tuple | None = None) -> dict:
    """Device-to-device copy, counting bytes read + written; ``buffers``: a
    ``copy_buffers`` pair to copy (kept by a caller that times the copy again and again)."""
    src, dst = copy_buffers(device, gib) if buffers is None else buffers
    r = time_fn(lambda: dst.copy_(src), device, iters=10)
    bytes_moved = 2 * src.numel() * src.element_size()
    return {"bytes": bytes_moved, "median_ms": r["median_ms"], "GBps": bytes_moved / r["median_ms"] / 1e6}


def step_bytes(tcfg, dcfg, batch: int, context: int) -> dict:
    """The fewest bytes one speculative step reads: every weight matrix once (embedding and W1 rows
    only where gathered), valid KV once. bf16 weights/KV; the decoder projections of an FP8 checkpoint
    (a config with ``quantization_config``: docs/fp8.md) one byte an element plus their float32 scale per
    output row, and an FP8 KV cache's target K/V one byte an element; fp32 residual gates and KV scales
    ignored (tiny)."""
    g, D, e = dcfg.block_size, tcfg.hidden_size, 2

    def layer_bytes(c) -> int:
        rows = c.qkv_out + D + 2 * c.intermediate_size + D  # output rows of qkv, o, gate_up, down
        elements = c.qkv_out * D + c.q_size * D + 3 * c.intermediate_size * D
        return elements + 4 * rows if c.quantization_config is not None else elements * e

    t_layer, d_layer = layer_bytes(tcfg), layer_bytes(dcfg)
    target_w = tcfg.num_hidden_layers * t_layer + tcfg.vocab_size * D * e + batch * (g + 1) * D * e
    draft_w = (dcfg.num_hidden_layers * d_layer + dcfg.draft_vocab_size * D * e  # layers, lm_head
               + dcfg.hidden_size * dcfg.target_hidden_size * len(dcfg.target_layer_ids) * e  # fc
               + dcfg.draft_vocab_size * dcfg.markov_rank * e + batch * g * dcfg.markov_rank * e  # W2, W1 rows
               + batch * g * D * e)  # embedding rows of the block
    kv_row = 2 * tcfg.num_key_value_heads * tcfg.head_dim * e  # K and V of one position, one layer
    fp8_kv = getattr(tcfg, "fp8_kv_cache", False)  # (an FP8 KV cache: one byte an element)
    target_kv = tcfg.num_hidden_layers * batch * (context + g + 1) * (kv_row // e if fp8_kv else kv_row)
    draft_kv = dcfg.num_hidden_layers * batch * context * kv_row
    return {"weights": target_w + draft_w, "kv": target_kv + draft_kv,
            "total": target_w + draft_w + target_kv + draft_kv}


def time_in_graph(calls, reps: int, replays: int = 20, graph: bool = True) -> tuple[float, str]:
    """µs per call: ``calls`` (closures) captured ``reps``× in one CUDA graph; eager if capture fails."""
    import torch

    for c in calls:  # warm up: compile, allocate
        c()
    torch.cuda.synchronize()
    try:
        if not graph:
            raise RuntimeError("not captured")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                calls[i % len(calls)]()
        run, how = graph.replay, "graph"
    except Exception as e:  # noqa: BLE001 — report and time eagerly
        torch.cuda.synchronize()
        if graph:
            print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eagerly)")

        def run():
            for i in range(reps):
                calls[i % len(calls)]()

        how = "eager"
    r = time_fn(run, torch.device("cuda"), iters=replays, warmup=1)
    return r["median_ms"] * 1000.0 / reps, how


def roofline_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to move ``nbytes`` at ``gbps`` GB/s: a step's floor on a bandwidth-bound device."""
    return nbytes / gbps / 1e6


def batch_list(text: str) -> list[int]:
    """``--batches``: comma-separated positive batch sizes, ``1,8,32``."""
    try:
        batches = [int(x) for x in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive batch sizes such as 1,8,32, got {text!r}")
    return batches
