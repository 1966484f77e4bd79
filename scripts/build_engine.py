#!/usr/bin/env python3
"""The build-engine script: a thin wrapper over `muse-spark build`.

    python scripts/build_engine.py --target DIR --draft DIR --out engines/NAME \
        [--backend eager] [--device cpu|cuda] [--max-batch N] [--max-seq N] [--dtype D]
"""

import sys

from muse_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
