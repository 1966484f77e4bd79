#!/usr/bin/env python3
"""The ONNX graphs (the ``tensorrt`` backend's input, docs/tensorrt.md) of a benchmark preset's
shapes, without weights: the weights are graph inputs, so the graphs (and a TensorRT build of
them) need only the shapes. On CPU, no checkpoint.

    python scripts/export_onnx_preset.py --out onnx-8b [--preset muse-spark-8b] [--max-batch 1] [--max-seq 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from presets import PRESETS, preset_configs  # benchmarks/presets.py

    from muse_spark.builder.onnx_export import export_onnx_dir, new_out_dir
    from muse_spark.graphs.parts import build_pair

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="muse-spark-8b")
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--max-seq", type=int, default=2048)
    a = p.parse_args()
    try:
        out = new_out_dir(a.out, a.max_batch)
        pair = build_pair(*preset_configs(a.preset))  # (on the meta device: shapes, no weights)
        t0 = time.perf_counter()
        section = export_onnx_dir(pair.target, pair.draft, out, max_batch=a.max_batch, max_seq=a.max_seq,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = {g["file"]: (out / g["file"]).stat().st_size for g in section["graphs"].values()}
    print(f"{len(sizes)} graphs in {time.perf_counter() - t0:.1f} s, {min(sizes.values()) / 1e6:.2f}–"
          f"{max(sizes.values()) / 1e6:.2f} MB each: {out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
