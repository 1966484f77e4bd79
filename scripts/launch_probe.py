#!/usr/bin/env python3
"""What a CUDA graph's launch costs the host, by what the stream did just before it.

    python scripts/launch_probe.py [--kernels 320] [--iters 200] [--json out.json]   # on a CUDA device

Why: on one machine start of the twenty-third session, the bench's standalone step (the runner's
input copies, then the step graph's launch) took the host 185 µs to issue, against 30 µs for the
copies and 50 µs for the launch, each timed alone; on another start, 26 against 17 and 6. This
probe separates the cases on a graph of plain kernels, so that a machine start can be told apart in
seconds and without the engine.

Two graphs of ``--kernels`` one-element adds each: ``serial`` (one stream) and ``forked`` (the last
third on a second stream, joined at the end: the step graph's shape, whose draft context runs on a
side stream). For each, the host's time in ``replay()`` after a synchronize (median µs), where the
stream's last work before the launch was:

* ``graph``: the same graph (the launch alone, as the bench's ``replay`` figure);
* ``kernel``: one small kernel, not waited for (as the runner's copies before its launch);
* ``kernel_sync``: one small kernel that the host waited for;
* ``h2d``: a host→device copy from pinned memory, not waited for (as ``step_host``'s copy);
* ``other_graph``: a one-kernel graph, not waited for.

Each figure is the pair's time less the predecessor's own, timed alone (``alone``). Prints a table
and the host description the bench records (kernel release, CPU, driver).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse_spark.bench import host_description, host_issue_us  # noqa: E402

PREDECESSORS = ("graph", "kernel", "kernel_sync", "h2d", "other_graph")


def capture(kernels: int, forked: bool, dev: torch.device) -> tuple[torch.cuda.CUDAGraph, list]:
    """A graph of ``kernels`` one-element adds (``forked``: the last third on a second stream)."""
    a, b = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    side = torch.cuda.Stream(dev)
    g = torch.cuda.CUDAGraph()
    main_n = kernels - kernels // 3 if forked else kernels
    with torch.cuda.graph(g):
        if forked:
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(kernels - main_n):
                    b.add_(1)
        for _ in range(main_n):
            a.add_(1)
        if forked:
            torch.cuda.current_stream(dev).wait_stream(side)
    return g, [a, b, side]


def probe(kernels: int, iters: int, dev: torch.device) -> dict:
    small = torch.zeros(1, device=dev)
    pinned = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    staged = torch.zeros(64, dtype=torch.int64, device=dev)
    tiny = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tiny):
        small.add_(1)

    def sync_kernel():
        small.add_(1)
        torch.cuda.current_stream(dev).synchronize()

    before = {"graph": lambda: None, "kernel": lambda: small.add_(1), "kernel_sync": sync_kernel,
              "h2d": lambda: staged.copy_(pinned, non_blocking=True), "other_graph": tiny.replay}
    alone = {k: host_issue_us(f, dev, iters) for k, f in before.items()}
    result = {"kernels": kernels, "iters": iters, "alone_us": alone, "graphs": {}}
    for name in ("serial", "forked"):
        g, keep = capture(kernels, name == "forked", dev)
        row = {}
        for k, f in before.items():
            def pair(f=f, g=g):
                f()
                g.replay()
            total = host_issue_us(pair, dev, iters)
            row[k] = {"total_us": total, "launch_us": total - alone[k]}
        result["graphs"][name] = row
        del g, keep
    return result


def render(result: dict) -> str:
    lines = [f"launch of a {result['kernels']}-kernel graph, host µs (median of {result['iters']}), "
             "by the stream's last work before it (the pair less the predecessor alone):",
             "| graph | " + " | ".join(PREDECESSORS) + " |", "|---|" + "---:|" * len(PREDECESSORS)]
    for name, row in result["graphs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]['launch_us']:.1f}" for k in PREDECESSORS) + " |")
    lines.append("predecessors alone: " + ", ".join(f"{k} {v:.1f}" for k, v in result["alone_us"].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, default=320, help="kernels in each graph (the step graph has 323)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("launch_probe: needs a CUDA device (it times CUDA graph launches)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    result = {"host": host_description("cuda"), "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              **probe(a.kernels, a.iters, dev)}
    print(json.dumps(result["host"]))
    print(render(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
