"""The engine directory's format, shared by the builder (which writes it) and the runtime (which reads it).

An engine directory (``engines/<name>/``) holds ``manifest.json`` and the engine
files. The manifest is not trusted more than the files it describes:
``read_manifest`` checks its limits against its configs (``max_seq`` within the
target's positions and room for a step, ``max_batch`` ≥ 1) and that every file it
names — the tokenizer included, which must be one of the hashed ``files`` — is a
relative path inside the engine directory; ``verify_files`` checks each file's
sha256. The KV caches an engine allocates must fit the device's memory: the
builder checks the total at build time, the runtime what is available before it
allocates (``check_cache_memory``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from muse_spark.checkpoint import file_sha256
from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig, missing_note, os_error_reason
from muse_spark.plugins import PLUGIN_VERSIONS

SCHEMA_VERSION = 1
ENGINE_FORMAT = "muse-spark-engine"


class EngineError(RuntimeError):
    """An engine directory that cannot be used here; the message says why."""


def read_manifest(engine_dir: str | Path) -> dict:
    d = Path(engine_dir)
    path = d / "manifest.json"
    try:
        if not d.is_dir():
            if d.exists():
                raise EngineError(f"engine directory {d} is not a directory")
            raise EngineError(f"engine directory {d} does not exist{missing_note(d)}")
        if not path.is_file():
            raise EngineError(f"{d} is not an engine directory: manifest.json is missing (build one with `muse-spark build`)")
        text = path.read_text()
    except OSError as e:
        raise EngineError(f"cannot read {e.filename or path}: {os_error_reason(e)}") from None
    try:
        m = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: corrupted manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != ENGINE_FORMAT:
        raise EngineError(f"{path}: not a Muse Spark engine manifest")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise EngineError(
            f"{path}: engine schema version {m.get('schema_version')} is not supported "
            f"(this runtime reads version {SCHEMA_VERSION}); rebuild the engine"
        )
    for key in ("backend", "files", "target_config", "draft_config", "gamma", "max_seq", "max_batch", "dtype"):
        if key not in m:
            raise EngineError(f"{path}: manifest lacks {key!r}")
    check_manifest_paths(d, m, path)
    check_manifest_limits(m, path)
    return m


def tp_world(manifest: dict) -> int:
    """The tensor-parallel ranks the engine of ``manifest`` was built for (``build --tp N``: its
    ``tensor_parallel`` section), 1 for an engine on one device."""
    return int((manifest.get("tensor_parallel") or {}).get("world") or 1)


def built_world(engine_dir: str | Path) -> int:
    """``tp_world`` of an engine directory, or 1 for one whose manifest does not read (loading it says why):
    the ranks a command runs it over when not told."""
    try:
        return tp_world(read_manifest(engine_dir))
    except (EngineError, OSError, ValueError, TypeError, KeyError):
        return 1


def _inside(engine_dir: Path, name, what: str, where) -> None:
    """``name`` (a manifest entry) is a relative path that stays inside the engine directory, links resolved."""
    if not isinstance(name, str) or not name:
        raise EngineError(f"{where}: {what} must be a file name inside the engine directory, got {name!r}")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise EngineError(f"{where}: {what} {name!r} points outside the engine directory; refusing to read it")
    root = engine_dir.resolve()
    if not (root / p).resolve().is_relative_to(root):
        raise EngineError(f"{where}: {what} {name!r} resolves outside the engine directory "
                          f"(to {(root / p).resolve()}); refusing to read it")


def check_manifest_paths(engine_dir: Path, m: dict, where) -> None:
    """Every engine file the manifest names, and its tokenizer, inside the engine directory; the
    tokenizer one of the hashed files (so ``verify_files`` covers it)."""
    files = m["files"]
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise EngineError(f"{where}: manifest 'files' must map file names to sha256 digests")
    for name in files:
        _inside(engine_dir, name, "engine file", where)
    tok = m.get("tokenizer")
    if tok is not None:
        _inside(engine_dir, tok, "tokenizer", where)
        if tok not in files:
            raise EngineError(f"{where}: tokenizer {tok!r} is not among the manifest's hashed files; "
                              "refusing an unverified tokenizer")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_manifest_limits(m: dict, where) -> None:
    """The manifest's limits against its own configs: what the builder checked, checked again here
    because the manifest itself is not hashed (an edited ``max_seq`` would run past the positions
    the target was trained for)."""
    for key in ("max_seq", "max_batch", "gamma"):
        if not _is_int(m[key]):
            raise EngineError(f"{where}: manifest {key} must be an integer, got {m[key]!r}")
    tcfg, dcfg = configs_from_manifest(m)
    gamma = dcfg.block_size
    if m["gamma"] != gamma:
        raise EngineError(f"{where}: manifest gamma {m['gamma']} differs from the draft's block_size {gamma}")
    if m["max_batch"] < 1:
        raise EngineError(f"{where}: manifest max_batch must be >= 1, got {m['max_batch']}")
    if m["max_seq"] < gamma + 2:
        raise EngineError(f"{where}: manifest max_seq {m['max_seq']} is below γ+2 = {gamma + 2}")
    if m["max_seq"] > tcfg.max_position_embeddings:
        raise EngineError(f"{where}: manifest max_seq {m['max_seq']} exceeds the target's max_position_embeddings "
                          f"{tcfg.max_position_embeddings}; rebuild the engine with a --max-seq within it")


# ---- memory ---------------------------------------------------------------------------------
def _cgroup_memory() -> tuple[int | None, int]:
    """This process's cgroup memory limit (None: unlimited) and its current use (cgroup v2, else v1)."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            limit = None if raw == "max" else int(raw)
            if limit is not None and limit >= 1 << 60:  # (v1 writes "unlimited" as a huge number)
                limit = None
            try:
                used = int(Path(usage_file).read_text().strip())
            except (OSError, ValueError):
                used = 0
            return limit, used
        except (OSError, ValueError):
            continue
    return None, 0


def device_memory(device, available: bool) -> int | None:
    """Bytes of memory of ``device`` (None: unknown). ``available=False``: its size (CPU: physical
    memory within this process's cgroup limit; CUDA: the GPU's total), the bound a build checks
    against; ``available=True``: what a load can allocate now (CPU: MemAvailable within the cgroup's
    headroom; CUDA: free memory plus this process's cached blocks)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(dev)
        if not available:
            return total
        return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    if dev.type != "cpu":
        return None
    limit, used = _cgroup_memory()
    try:
        if not available:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        else:
            size = None
            try:
                for line in Path("/proc/meminfo").read_text().splitlines():
                    if line.startswith("MemAvailable:"):
                        size = int(line.split()[1]) * 1024
            except OSError:
                pass
            if size is None:
                size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError):
        return None
    if limit is not None:
        size = min(size, limit if not available else max(limit - used, 0))
    return size


def cache_bytes(tcfg: MuseSpark1xConfig, dcfg: MuseSparkDSparkConfig, slots: int, max_seq: int, dtype) -> int:
    """Bytes of the target's and the draft's KV caches for ``slots`` slots of ``max_seq`` positions."""
    return tcfg.kv_cache_bytes(slots, max_seq, dtype) + dcfg.kv_cache_bytes(slots, max_seq, dtype)


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cache_memory_shortfall(tcfg, dcfg, dtype, *, max_batch: int, max_seq: int, memory: int | None,
                           device, extra_slots: int = 0, other_bytes: int = 0, what: str = "available") -> str | None:
    """Why ``max_batch`` slots (+ ``extra_slots``) of ``max_seq`` do not fit ``memory`` bytes beside
    ``other_bytes`` (weights), with the largest max_batch that does; None when they fit (or memory is unknown)."""
    if memory is None:
        return None
    need = cache_bytes(tcfg, dcfg, max_batch + extra_slots, max_seq, dtype)
    if need + other_bytes <= memory:
        return None
    per_slot = cache_bytes(tcfg, dcfg, 1, max_seq, dtype)
    fits = (memory - other_bytes) // per_slot - extra_slots if memory > other_bytes else 0
    beside = f" beside {other_bytes} bytes ({_human(other_bytes)}) of weights" if other_bytes else ""
    hint = (f"the largest max_batch that fits is {fits}" if fits >= 1 else
            f"not even max_batch 1 fits: lower max_seq (each slot needs {per_slot} bytes at max_seq {max_seq})")
    return (f"the KV caches for max_batch {max_batch} × max_seq {max_seq} need {need} bytes ({_human(need)}){beside}, "
            f"more than the {memory} bytes ({_human(memory)}) of memory {what} on {torch.device(device)}; {hint}")


def kv_pool_blocks(tokens: int, block_size: int, max_seq: int, error: type[EngineError] = EngineError,
                   where: str = "") -> int:
    """The blocks of a paged KV pool of ``tokens`` positions in blocks of ``block_size`` (one more: block 0,
    which no request holds, ``runtime/kv_blocks.py``), checked (``error`` raised, its message after ``where``):
    a power-of-two block size (what the kernels that read and write through block tables take), and room for
    one request of ``max_seq`` positions (a request that fits the window must fit the pool alone)."""
    if not (_is_int(block_size) and block_size >= 1 and block_size & (block_size - 1) == 0):
        raise error(f"{where}KV block size must be a power of two, got {block_size!r}")
    blocks = -(-int(tokens) // block_size) + 1
    per_request = -(-max_seq // block_size)
    if blocks - 1 < per_request:
        raise error(
            f"{where}a KV pool of {blocks} blocks of {block_size} tokens ({blocks - 1} usable: block 0 is kept "
            f"empty) cannot hold one request of max_seq {max_seq} tokens ({per_request} blocks): give it at least "
            f"{per_request * block_size} tokens")
    return blocks


def manifest_kv_pool(pool, max_seq: int, where, section: str = "aoti") -> tuple[int, int] | None:
    """A compiled engine's paged pool as its manifest records it (``<section>.kv_pool``: [blocks, block size];
    null or absent: a window of max_seq positions per slot) → (blocks, block size), or None. The manifest is
    not hashed, so the pool is checked as the build checked it (``kv_pool_blocks``): two positive integers, a
    block size the kernels take, and blocks for one max_seq request beside block 0 (``EngineError``)."""
    if pool is None:
        return None
    what = f"{where}: manifest {section}.kv_pool"
    if not (isinstance(pool, list) and len(pool) == 2 and all(_is_int(v) and v >= 1 for v in pool)):
        raise EngineError(f"{what} must be [blocks, block size], two positive integers (null: a window per "
                          f"slot), got {json.dumps(pool)}; rebuild the engine")
    blocks, block_size = pool
    kv_pool_blocks((blocks - 1) * block_size, block_size, max_seq, EngineError, where=f"{what} {pool}: ")
    return blocks, block_size


def kv_tokens_in_memory(fraction: float, tcfg, dcfg, dtype, device, block_size: int, max_seq: int,
                        where: str = "") -> int:
    """The positions a paged KV pool holds in ``fraction`` of ``device``'s available memory (in whole blocks):
    every target and draft layer's K and V of a position. Refused (``EngineError``) where the fraction is not
    in (0, 1], the memory is unknown, or it cannot hold one request of ``max_seq`` positions."""
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise EngineError(f"{where}KV cache memory fraction must be in (0, 1], got {fraction!r}")
    memory = device_memory(device, available=True)
    if memory is None:
        raise EngineError(f"{where}the available memory of {device} is unknown: give the pool in tokens "
                          f"(--kv-cache-tokens) instead of a memory fraction")
    per_position = cache_bytes(tcfg, dcfg, 1, 1, dtype)
    tokens = int(fraction * memory) // per_position // block_size * block_size
    if tokens < max_seq + block_size:  # (block 0 comes out of it too)
        raise EngineError(f"{where}{fraction:g} of the available memory ({_human(memory)}) holds {tokens} KV positions "
                          f"({_human(per_position)} each), not one request of max_seq {max_seq}: give a larger "
                          f"fraction, or free memory")
    return tokens - block_size


def check_cache_memory(engine_dir, tcfg, dcfg, dtype, *, max_batch: int, max_seq: int, device,
                       extra_slots: int = 0) -> None:
    """Refuse (``EngineError``) before allocating KV caches that the device's available memory cannot hold."""
    why = cache_memory_shortfall(tcfg, dcfg, dtype, max_batch=max_batch, max_seq=max_seq, extra_slots=extra_slots,
                                 memory=device_memory(device, available=True), device=device)
    if why:
        raise EngineError(f"{engine_dir}: cannot load the engine: {why} (load it with a smaller max_batch, or "
                          f"rebuild it with a smaller --max-batch or --max-seq)")


def verify_files(engine_dir: str | Path, manifest: dict) -> None:
    """Every file the manifest lists exists and matches its sha256."""
    d = Path(engine_dir)
    for name, digest in manifest["files"].items():
        p = d / name
        try:
            if not p.is_file():
                if p.exists():
                    raise EngineError(f"{d}: engine file {name} is not a regular file")
                raise EngineError(f"{d}: engine file {name} is missing")
            actual = file_sha256(p)
        except OSError as e:
            raise EngineError(f"{d}: cannot read engine file {e.filename or p}: {os_error_reason(e)}") from None
        if actual != digest:
            raise EngineError(
                f"{d}: engine file {name} does not match the manifest's hash "
                f"(expected sha256 {digest[:16]}…, got {actual[:16]}…): the engine is corrupted or was modified"
            )


def check_plugins(manifest: dict) -> None:
    built = manifest.get("plugins", {})
    for name, version in built.items():
        if PLUGIN_VERSIONS.get(name) != version:
            raise EngineError(
                f"engine was built with plugin {name} v{version}; this runtime has "
                f"v{PLUGIN_VERSIONS.get(name)}: rebuild the engine"
            )


def configs_from_manifest(m: dict) -> tuple[MuseSpark1xConfig, MuseSparkDSparkConfig]:
    try:
        tcfg = MuseSpark1xConfig.from_dict(m["target_config"], "manifest target_config")
        dcfg = MuseSparkDSparkConfig.from_dict(m["draft_config"], "manifest draft_config")
        dcfg.validate_against(tcfg)
    except ValueError as e:
        raise EngineError(f"engine manifest holds an invalid config: {e}") from None
    return tcfg, dcfg
