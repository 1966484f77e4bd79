"""Engine builder: checkpoint pair → ``engines/<name>/`` (manifest.json + engine files).

The ``eager`` backend stores the canonical (stacked, validated, converted)
weights as safetensors next to the configs and the tokenizer; the manifest
records what DESIGN.md §4 asks for (schema, backend, device, versions,
configs, checkpoint tensor hashes, dtype, γ, limits, batch buckets, plugin
versions, tokenizer and a sha256 of every engine file). The ``migraphx`` backend
writes the same files (its runtime compiles the step through MIGraphX on ROCm:
``runtime/migraphx_engine.py``); ``aoti`` adds its packages (``builder/aoti.py``), ``tensorrt``
its parts as ONNX graphs and TensorRT plans (``builder/tensorrt.py``; unverified here).
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import time
from pathlib import Path

import torch

import muse_spark
from muse_spark.checkpoint import file_sha256, load_pair, save_canonical, tensors_hash
from muse_spark.config import dtype_name
from muse_spark.models.layers import nvidia
from muse_spark.plugins import PLUGIN_VERSIONS
from muse_spark.runtime.engine import ENGINE_FORMAT, SCHEMA_VERSION

BACKENDS = ("eager", "aoti", "tensorrt", "migraphx")


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[build] {msg}", file=sys.stderr, flush=True)


def default_buckets(max_batch: int) -> list[int]:
    b, out = 1, []
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def device_info(device: str) -> dict:
    dev = torch.device(device)
    info = {"kind": dev.type, "name": "cpu", "compute_capability": None}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        cc = torch.cuda.get_device_capability(dev)
        info.update(name=torch.cuda.get_device_name(dev), compute_capability=list(cc))
    return info


def versions() -> dict:
    v = {"torch": torch.__version__, "muse_spark": muse_spark.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    return v


def check_max_batch(max_batch: int) -> None:
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")


def check_max_seq(target, draft, max_seq: int) -> None:
    """--max-seq against the pair: room for a step's γ + 1 tokens after an anchor, within the target's positions."""
    gamma = draft.cfg.block_size
    if max_seq < gamma + 2:
        raise ValueError(f"--max-seq must be at least γ+2 = {gamma + 2}, got {max_seq}")
    if max_seq > target.cfg.max_position_embeddings:
        raise ValueError(
            f"--max-seq {max_seq} exceeds the target's max_position_embeddings {target.cfg.max_position_embeddings}"
        )


def build_engine(target_dir: str | Path, draft_dir: str | Path, out: str | Path, *, backend: str = "eager",
                 device: str = "cpu", max_batch: int = 8, max_seq: int = 1024, dtype: str | None = None,
                 overwrite: bool = True, quiet: bool = False, **aoti_options) -> dict:
    """Build an engine directory; returns its manifest.

    ``aoti_options`` (backend ``aoti`` only): ``buckets``, ``prefill_chunk``,
    ``fast_compile``, ``plugins``, ``jobs`` — see ``builder/aoti.py``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (expected one of {list(BACKENDS)})")
    if backend == "tensorrt":
        if torch.device(device).type != "cuda":
            raise ValueError("--backend tensorrt builds plans for a CUDA GPU: give --device cuda "
                             "(`muse-spark export-onnx` writes the device-free ONNX graphs)")
        from muse_spark.builder.tensorrt import require_tensorrt

        require_tensorrt()  # (before anything is loaded: the reason a build cannot start)
    if backend == "migraphx" and nvidia(device):
        _log("note: a migraphx engine compiles its step through MIGraphX on ROCm GPUs only; on this CUDA "
             "build of torch it will run the plain eager path (--backend aoti is the NVIDIA path)", quiet)
    if aoti_options and backend != "aoti":
        raise ValueError(f"options {sorted(aoti_options)} apply to --backend aoti only")
    check_max_batch(max_batch)
    t0 = time.perf_counter()
    out = Path(out)
    _log(f"loading checkpoints {target_dir} + {draft_dir}", quiet)
    target, draft = load_pair(target_dir, draft_dir, dtype, "cpu")
    gamma = draft.cfg.block_size
    check_max_seq(target, draft, max_seq)
    dev = device_info(device)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists")
        if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
            raise FileExistsError(f"{out} exists and is not an engine directory; refusing to overwrite it")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _log("hashing checkpoint tensors", quiet)
    hashes = {"target": tensors_hash(target_dir), "draft": tensors_hash(draft_dir)}
    _log("writing engine weights", quiet)
    save_canonical(target, tmp / "target.safetensors")
    save_canonical(draft, tmp / "draft.safetensors")
    aoti = embedding = trt = None
    if backend == "tensorrt":
        from muse_spark.builder.tensorrt import build_tensorrt

        trt = build_tensorrt(target, draft, tmp, max_batch=max_batch, max_seq=max_seq, log=lambda m: _log(m, quiet))
    if backend == "aoti":
        from muse_spark.builder.aoti import build_aoti

        aoti = build_aoti(target, draft, tmp, device=device, max_batch=max_batch, max_seq=max_seq,
                          log=lambda m: _log(m, quiet), **aoti_options)
        from muse_spark.builder.embedder import embedding_section

        # (for the C++ embedding: the weights' sources, the parts' weights, the caches; derived.safetensors)
        embedding = embedding_section(target, draft, tmp, cache_slots=aoti["cache_slots"], max_seq=max_seq)
    tokenizer = None
    for src in (Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"):
        if src.is_file():
            shutil.copy(src, tmp / "tokenizer.json")
            tokenizer = "tokenizer.json"
            break
    parts = aoti or trt  # (the section that plans the compiled parts, if any)
    files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {
        "format": ENGINE_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "backend": backend,
        "device": dev,
        "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target_config": target.cfg.to_dict(),
        "draft_config": draft.cfg.to_dict(),
        "checkpoint_hashes": hashes,
        "dtype": dtype_name(target.dtype),
        "gamma": gamma,
        "max_seq": max_seq,
        "max_batch": max_batch,
        "batch_buckets": parts["batch_buckets"] if parts else default_buckets(max_batch),
        "plugins": dict(PLUGIN_VERSIONS),
        "tokenizer": tokenizer,
        "files": files,
    }
    if aoti:
        manifest["aoti"] = aoti
        manifest["embedding"] = embedding
    if trt:
        manifest["tensorrt"] = trt
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.rename(out)
    _log(f"engine written to {out} in {time.perf_counter() - t0:.1f}s", quiet)
    return manifest
