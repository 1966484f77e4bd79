#!/usr/bin/env python3
"""The benchmark script: the same as `muse-spark bench` (muse_spark/bench.py).

    python scripts/bench.py [--preset muse-spark-8b|tiny] [--batches 1,8,32] [--context 1024] \
        [--json docs/benchmarks.json] [--markdown docs/benchmarks.md] [--skip eager,compile,aoti]

On the GPU with the default preset it needs about 40 GB of device memory and
several minutes (the aoti step graphs and torch.compile are compiled in the run).
"""

import sys

from muse_spark.bench import main

if __name__ == "__main__":
    sys.exit(main())
