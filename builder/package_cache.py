"""The build cache: compiled AOTI packages kept by what they were compiled from.

A package is a function of its compile job alone (``aoti.graph_jobs``: the part, its batch and token
shapes, both models' configs, the names, shapes and dtypes of the weights it takes, the kernel and
Inductor options), of the code that traces and compiles it (this project's sources, torch, Triton)
and of the device it was compiled for. The weights' *values* are not in it: every part takes its
weights as inputs. So a build whose job hashes to a package compiled before takes that package
instead of compiling it again: a pair of other weights with the same shapes (another checkpoint of
the same model, a draft trained further), or another build of the same pair with options that change
only some parts (a KV pool, another verification width) costs seconds where a fresh 8B build takes
minutes on the GPU.

The cache is a folder of ``<key>.pt2`` files (``options.BUILD_CACHE_ENV``; default
``~/.cache/muse-spark/packages``, under ``XDG_CACHE_HOME`` where that is set; ``off`` turns it off;
``muse-spark build --build-cache``). Writes go to a temporary file renamed into place, so builds
running at once never see a torn package; a stored package that does not read back whole
(``check_package``) is dropped and compiled again. The folder is kept under
``options.BUILD_CACHE_GB_ENV`` (default 8) by removing the packages least recently used. A cache that
cannot be written is reported once and the build goes on without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from muse_spark.options import build_cache_limit_gb, build_cache_setting

DEFAULT_LIMIT_GB = 8.0
OFF = ("off", "0", "no", "none", "false")
# A job's fields that say where its package goes and how fast it compiles, not what it compiles.
NOT_COMPILED = ("out", "compile_threads", "name")
# The packages whose sources trace or compile a part (the runtime's are in it too: it is cheap to hash
# and a part's code may import it).
SOURCE_PACKAGES = ("muse_spark", "muse_spark.builder", "muse_spark.plugins", "muse_spark.runtime")


def check_package(path: str | Path) -> None:
    """Refuse an AOTI package whose JSON members are empty or do not parse (a package assembled
    from files another process was rewriting): the loader would fail later, far from the cause."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        for member in (n for n in z.namelist() if n.endswith(".json")):
            try:
                json.loads(z.read(member) or b"")
            except ValueError as e:
                raise RuntimeError(f"AOTI package {path}: {member} is not valid JSON ({e}); the compile's "
                                   "files were changed while it was packaged (another compile of the same "
                                   "graph sharing TORCHINDUCTOR_CACHE_DIR?); build again") from None


def cache_folder(setting: str | None = None) -> Path | None:
    """The cache's folder: ``setting`` (a folder, or ``off``), else the build-cache variable's
    (``options.build_cache_setting``), else the default under the user's cache folder; None: no cache."""
    if setting is None:
        setting = build_cache_setting()
    if setting is not None and str(setting).strip().lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "muse-spark" / "packages"


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 over this project's Python sources (relative path and bytes of each file): any edit to
    the code that traces a part makes every key new."""
    h = hashlib.sha256()
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def device_identity(device: str) -> dict:
    """What a package compiled for ``device`` is specific to: the GPU's name and compute capability and
    the CUDA torch was built with; on a CPU, its architecture and the vector ISA Inductor compiles for."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev.index if dev.index is not None else torch.cuda.current_device())
        return {"type": "cuda", "name": props.name, "capability": [props.major, props.minor],
                "cuda": torch.version.cuda}
    return {"type": dev.type, "machine": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def toolchain() -> dict:
    """What compiles a package: the versions of torch, Triton (where it imports) and Python, and the
    variables that steer Inductor and Triton (``TORCHINDUCTOR_*``, ``TRITON_*``, but the folders)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("TORCHINDUCTOR_", "TRITON_")) and not k.endswith(("_DIR", "_HOME", "_PATH"))}
    return {"torch": torch.__version__, "triton": triton_version, "python": list(sys.version_info[:2]), "env": env}


class PackageCache:
    """A folder of compiled packages by key (see the module docstring)."""

    def __init__(self, root: Path, device: str, limit_bytes: int | None = None,
                 log: Callable[[str], None] = lambda m: None):
        self.root, self.log = Path(root), log
        self.root.mkdir(parents=True, exist_ok=True)
        if limit_bytes is None:
            limit_bytes = int((build_cache_limit_gb() or DEFAULT_LIMIT_GB) * 2**30)
        self.limit_bytes = limit_bytes
        self.context = {"source": source_digest(), "device": device_identity(device), "toolchain": toolchain()}
        self.broken: str | None = None  # why storing stopped (a full disk, a folder not writable)

    def key(self, job: dict) -> str:
        """The job's key: a hash of what it compiles (its fields but ``NOT_COMPILED``) and of this
        cache's context (sources, device, toolchain)."""
        what = {k: v for k, v in job.items() if k not in NOT_COMPILED}
        text = json.dumps({"job": what, **self.context}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def path(self, job: dict) -> Path:
        return self.root / f"{self.key(job)}.pt2"

    def lookup(self, job: dict) -> Path | None:
        """The stored package of ``job``, or None. One that does not read back whole is removed."""
        path = self.path(job)
        if not path.is_file():
            return None
        try:
            check_package(path)
        except Exception as e:  # (a truncated zip raises BadZipFile; a torn one, check_package's error)
            self.log(f"build cache: {path.name} does not read back ({type(e).__name__}); compiling it again")
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # (recently used: pruned last)
        return path

    def take(self, job: dict) -> bool:
        """Put the stored package of ``job`` at ``job["out"]`` (a hard link, else a copy) → whether there
        was one."""
        src = self.lookup(job)
        if src is None:
            return False
        out = Path(job["out"])
        out.unlink(missing_ok=True)
        try:
            os.link(src, out)
        except OSError:  # (another file system, or one without hard links)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, out)
        return True

    def store(self, job: dict) -> None:
        """Keep the package just compiled at ``job["out"]``; a failure to write stops storing (said once)
        and never fails the build."""
        if self.broken:
            return
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            os.fchmod(fd, 0o644)  # (mkstemp's 0600 would follow the hard links into engines others serve)
            with os.fdopen(fd, "wb") as f:
                f.write(Path(job["out"]).read_bytes())
            os.replace(tmp, self.path(job))
            tmp = None
            self.prune()
        except OSError as e:
            self.broken = f"{type(e).__name__}: {e}"
            self.log(f"build cache: cannot store in {self.root} ({self.broken}); building without it")
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def prune(self) -> None:
        """Remove the least recently used packages until the folder is under ``limit_bytes``."""
        files = []
        for p in self.root.glob("*.pt2"):
            try:
                st = p.stat()
            except FileNotFoundError:  # (pruned by a build running at once)
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.limit_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size


def open_cache(setting: str | None, device: str, log: Callable[[str], None] = lambda m: None) -> PackageCache | None:
    """The build cache ``setting`` names (``cache_folder``) for ``device``, or None where it is off or its
    folder cannot be made (said, then the build compiles everything)."""
    root = cache_folder(setting)
    if root is None:
        return None
    try:
        return PackageCache(root, device, log=log)
    except OSError as e:
        log(f"build cache: cannot use {root} ({type(e).__name__}: {e}); building without it")
        return None
