"""Engines from a checkpoint pair (``muse-spark make-pair``'s folder: ``target/``, ``draft/``,
``pair.json``) for the benchmarks that take ``--pair`` instead of a built ``--engine``."""

from __future__ import annotations

import json
from pathlib import Path


def default_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def default_backend(device: str) -> str:
    """aoti (its steps replayed from CUDA graphs) on CUDA; eager elsewhere (an aoti compile for the
    CPU takes minutes and is not what anyone serves)."""
    return "aoti" if device == "cuda" else "eager"


def check_pair(pair: str | Path) -> Path:
    pair = Path(pair)
    missing = [sub for sub in ("target", "draft") if not (pair / sub / "config.json").is_file()]
    if missing:
        raise SystemExit(f"--pair {pair}: no {' or '.join(missing)} checkpoint there (expected {pair}/target and "
                         f"{pair}/draft, as `muse-spark make-pair --out {pair}` writes them)")
    return pair


def pair_summary(pair: str | Path) -> dict:
    """``pair.json`` (how the pair was made: preset, acceptance, seed …); {} where there is none."""
    f = Path(pair) / "pair.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def pair_gamma(pair: str | Path) -> int:
    return int(json.loads((Path(pair) / "draft" / "config.json").read_text())["block_size"])


def window(prompt_len: int, max_tokens: int, gamma: int) -> int:
    """The max_seq a run needs: prompt + output + two steps of γ+1 positions (a chained step's writes
    stay inside the window until the end), rounded up to a multiple of 64."""
    need = prompt_len + max_tokens + 2 * (gamma + 1)
    return -(-need // 64) * 64


def build_from_pair(pair: str | Path, work_dir: str | Path, *, backend: str, device: str, max_batch: int,
                    max_seq: int, log, buckets: list[int] | None = None, verify_widths=None,
                    reuse: bool = False, kv_pool: list[int] | None = None, kv_cache_dtype: str | None = None,
                    prefill_batch: int = 1) -> Path:
    """Build an engine from the pair into ``work_dir`` (replacing one built there before) → its folder.
    The build reports its progress on stderr. ``buckets``: the aoti engine's batch buckets (default:
    powers of two up to max_batch); a benchmark that runs only some batch sizes compiles only those.
    ``verify_widths``: the aoti engine's narrower verification widths (``build --verify-widths``;
    "default": the ones ``--schedule confidence`` builds). ``kv_pool``: [blocks, block size], the aoti
    engine's paged KV pool (``build --kv-cache-tokens``; default: a window per slot). ``kv_cache_dtype``: the
    target's KV cache (``build --kv-cache-dtype``; default: as the checkpoint says). ``prefill_batch``: the aoti
    engine's prefill of up to that many chunks a call (``build --prefill-batch``). ``reuse``: an engine
    already built there by the same plan (its folder's name says backend, device, max_batch, max_seq, the
    pool, the KV cache's dtype and the prefill batch) is used as it is."""
    from muse_spark.builder.build import build_engine

    pair = check_pair(pair)
    pool = f"-pool{kv_pool[0]}x{kv_pool[1]}" if kv_pool else ""
    kv = f"-kv{kv_cache_dtype}" if kv_cache_dtype else ""
    pb = f"-p{prefill_batch}" if prefill_batch > 1 else ""
    out = Path(work_dir) / f"engine-{backend}-{device}-b{max_batch}-s{max_seq}{pool}{kv}{pb}"
    if reuse and (out / "manifest.json").is_file():
        log(f"reusing the engine built before in {out}")
        return out
    log(f"building an engine from {pair} ({backend} backend, {device}, max_batch {max_batch}, max_seq {max_seq}"
        f"{f', a KV pool of {kv_pool[0]} blocks of {kv_pool[1]}' if kv_pool else ''}"
        f"{f', a {kv_cache_dtype} KV cache' if kv_cache_dtype else ''}"
        f"{f', a prefill of up to {prefill_batch} chunks a call' if prefill_batch > 1 else ''}) into {out}")
    build_engine(pair / "target", pair / "draft", out, backend=backend, device=device, max_batch=max_batch,
                 max_seq=max_seq, overwrite=True, quiet=False, kv_cache_dtype=kv_cache_dtype,
                 **({"buckets": sorted(set(buckets))} if buckets and backend == "aoti" else {}),
                 **({"verify_widths": verify_widths} if verify_widths and backend == "aoti" else {}),
                 **({"kv_pool": list(kv_pool)} if kv_pool and backend == "aoti" else {}),
                 **({"prefill_batch": prefill_batch} if prefill_batch > 1 and backend == "aoti" else {}),
                 # (the benchmarks send no sampling controls: their steps are not compiled, minutes less at 8B)
                 **({"sampling_controls": False} if backend == "aoti" else {}))
    return out


def parse_engine_arguments(p, argv):
    """``p.parse_args(argv)``, refusing what only a pair's build takes with ``--engine``."""
    a = p.parse_args(argv)
    if a.engine and a.kv_cache_dtype is not None:
        p.error("--kv-cache-dtype is for --pair: an engine's KV cache is chosen when it is built (muse-spark build "
                "--kv-cache-dtype)")
    return a


def add_engine_arguments(p, work_dir: str | None = None) -> None:
    """The engine a benchmark runs: ``--engine DIR`` or ``--pair DIR`` (built first, ``--backend``,
    into ``--work-dir``), and ``--device``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="an engine directory")
    src.add_argument("--pair", help="a make-pair folder (target/, draft/, pair.json): an engine is built from it first")
    p.add_argument("--backend", choices=["aoti", "eager"], default=None,
                   help="with --pair: the engine's backend (default aoti on cuda, eager on cpu)")
    p.add_argument("--work-dir", default=work_dir,
                   help="with --pair: where the engine is built (default: " + (work_dir or "a temporary folder") + ")")
    p.add_argument("--reuse-engine", action="store_true",
                   help="with --pair: use the engine an earlier run built in --work-dir instead of building again")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: the engine's own (--pair: cuda where available)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="with --pair: the target's KV cache (muse-spark build --kv-cache-dtype; default: as the "
                        "target checkpoint says)")

