"""One schema for every benchmark result: ``benchmarks/results/<date>_<gpu>_<commit>_<benchmark>.json``.

Each file records what it takes to trust and repeat the figures: the date, the device, the commit
(and whether the tree had uncommitted changes), the versions, and the exact command.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

SCHEMA = 1
RESULTS = Path(__file__).resolve().parent / "results"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict:
    import numpy
    import torch

    import muse_spark

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "muse_spark": muse_spark.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def record(benchmark: str, config: dict, results: dict, command: list[str] | None = None) -> dict:
    """The result document (not yet written)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "device": device_name(),
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "versions": versions(),
        "command": " ".join(command if command is not None else [Path(sys.executable).name, *sys.argv]),
        "config": config,
        "results": results,
    }


def write(doc: dict, out_dir: Path = RESULTS) -> Path:
    """Write ``doc`` under ``out_dir`` with a name from its date, device, commit and benchmark."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^a-z0-9]+", "-", doc["device"].lower()).strip("-")[:24]
    path = out_dir / f"{doc['date'][:10]}_{device}_{doc['commit'] or 'nogit'}_{doc['benchmark']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
