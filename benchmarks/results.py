"""One schema for every benchmark result: ``benchmarks/results/<date>_<gpu>_<commit>_<benchmark>.json``.

Each file records what it takes to trust and repeat the figures: the date, the device, the commit
(and whether the tree had uncommitted changes), the versions, and the exact command. A result of code that was
tried and then removed carries ``"dropped"`` (why, and where docs/log.md tells it): it stays for the record,
and ``load`` leaves it out of the current figures.
"""

from __future__ import annotations

import datetime
import json
import os
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


def _dirty() -> bool | None:
    """Whether tracked files differ from the commit; None where there is no git checkout to ask."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def cpu_name() -> str:
    return f"cpu ({platform.processor() or platform.machine()})"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_name()


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


def record(benchmark: str, config: dict, results: dict, command: list[str] | None = None,
           device: str | None = None) -> dict:
    """The result document (not yet written). ``device``: what ran it, where not the default device
    (a CPU run on a machine with a GPU)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "device": device or device_name(),
        # a copy of the tree sent to another machine names its commit in BENCH_COMMIT (its own git
        # metadata, if any, may be older than the files it carries)
        "commit": os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short=12", "HEAD"),
        "dirty": None if os.environ.get("BENCH_COMMIT") else _dirty(),
        "versions": versions(),
        "command": " ".join(command if command is not None else [Path(sys.executable).name, *sys.argv]),
        "config": config,
        "results": results,
    }


def _same_run(path: Path, doc: dict) -> bool:
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(old, dict) and (old.get("date"), old.get("command")) == (doc["date"], doc["command"])


def write(doc: dict, out_dir: Path = RESULTS) -> Path:
    """Write ``doc`` under ``out_dir`` with a name from its date, device, commit and benchmark. The same
    run (date and command) written again replaces its file (a run that saves as it goes); another
    run of the same day, device, commit and benchmark gets the next free ``-2``, ``-3``, ... name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^a-z0-9]+", "-", doc["device"].lower()).strip("-")[:24]
    stem = f"{doc['date'][:10]}_{device}_{doc['commit'] or 'nogit'}_{doc['benchmark']}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists() and not _same_run(path, doc):
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load(out_dir: Path = RESULTS, benchmark: str | None = None, dropped: bool = False) -> list[dict]:
    """The result documents under ``out_dir`` (of ``benchmark`` only, if given), oldest first, each
    with its file name as ``_file``; those of dropped code (``"dropped"``) only with ``dropped``."""
    docs = []
    for path in sorted(Path(out_dir).glob("*.json")):
        doc = json.loads(path.read_text())
        if not (isinstance(doc, dict) and doc.get("schema")) or (doc.get("dropped") and not dropped):
            continue
        if benchmark is None or doc.get("benchmark") == benchmark:
            docs.append(dict(doc, _file=path.name))

    def order(d: dict) -> tuple:  # by date, then name, a run's -2, -3, ... after its first
        m = re.fullmatch(r"(.*?)(?:-(\d+))?", Path(d["_file"]).stem)
        return d["date"], m.group(1), int(m.group(2) or 1)

    return sorted(docs, key=order)
