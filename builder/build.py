"""Engine builder: checkpoint pair → ``engines/<name>/`` (manifest.json + engine files).

The ``eager`` backend stores the canonical (stacked, validated, converted)
weights as safetensors next to the configs and the tokenizer; the manifest
records what docs/design.md lists (schema, backend, device, versions,
configs, checkpoint tensor hashes, dtype, γ, limits, batch buckets, plugin
versions, tokenizer, tokenizer config and a sha256 of every engine file). The ``migraphx`` backend
writes the same files (its runtime compiles the step through MIGraphX on ROCm:
``runtime/migraphx_engine.py``); ``aoti`` adds its packages (``builder/aoti.py``), ``tensorrt``
its parts as ONNX graphs and TensorRT plans (``builder/tensorrt.py``; unverified here).

The build takes its kernel options (``muse_spark/options.py``) once, from the environment unless
the caller passes them, builds everything under them, and records them in the manifest
(``"options"``) for the runtime to read back.

A build never leaves a half-written engine at ``--out``, nor loses the engine
that was there:

* everything is checked before anything is written: the checkpoints (names,
  shapes, dtypes), the tokenizer (it must load), ``--max-seq`` against the
  target, and ``--max-batch`` against the device's memory (the KV caches the
  runtime allocates for ``max_batch × max_seq`` beside the weights);
* the engine is written into a private temporary folder beside ``--out``
  (``.<name>.building-<random>``, same file system), then swapped in by renames:
  the old engine is moved aside (``.<name>.replaced-<random>``), the new one
  renamed to ``--out``, the old one removed. A failure before the swap leaves the
  old engine untouched; SIGTERM/SIGHUP during a build remove the temporary
  folder, then end the process as the signal would; during the swap they wait
  until it is done;
* builds into one ``--out`` are serialized by an exclusive ``flock`` on
  ``<out>.lock`` beside it (kept: removing a lock file races with its next
  user). A second build waits for the first, saying so, then replaces its
  engine. Under the lock, what a killed build left (temporary folders, an engine
  moved aside but never replaced) is cleaned up: an engine moved aside while
  ``--out`` is missing is restored first.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import muse_spark
from muse_spark.builder.limits import check_max_batch, check_max_seq
from muse_spark.checkpoint import CheckpointError, file_sha256, load_pair, save_canonical, tensors_hash, unreadable
from muse_spark.config import dtype_name, load_config, missing_note, os_error_reason
from muse_spark.models.layers import nvidia
from muse_spark.options import KernelOptions, use_options
from muse_spark.sharding import check_split, shard_state_dict
from muse_spark.plugins import PLUGIN_VERSIONS
from muse_spark.engine_format import ENGINE_FORMAT, SCHEMA_VERSION, cache_memory_shortfall, device_memory

BACKENDS = ("eager", "aoti", "tensorrt", "migraphx")
TEMP_TAG, ASIDE_TAG = ".building-", ".replaced-"  # .<name>.building-<random>, .<name>.replaced-<random>


class BuildError(ValueError):
    """A build that cannot run or cannot write its engine; the message names the path and why."""


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


def check_memory(target, draft, *, backend: str, device: str, max_batch: int, max_seq: int) -> None:
    """--max-batch × --max-seq against the device's memory: the KV caches the runtime allocates
    (``max_batch`` slots; an aoti engine one more, for padded rows) beside the weights."""
    weights = sum(t.numel() * t.element_size() for m in (target, draft) for t in m.state_dict().values())
    why = cache_memory_shortfall(target.cfg, draft.cfg, target.dtype, max_batch=max_batch, max_seq=max_seq,
                                 extra_slots=1 if backend == "aoti" else 0, other_bytes=weights,
                                 memory=device_memory(device, available=False), device=device, what="in total")
    if why:
        raise BuildError(f"--max-batch {max_batch} does not fit: {why} (give a smaller --max-batch or --max-seq)")


def _pair_file(target_dir, draft_dir, name: str, what: str) -> tuple[Path, bytes] | None:
    """The pair's file ``name`` (the target's, else the draft's) → (its path, its bytes); None when
    neither folder has one."""
    for src in (Path(target_dir) / name, Path(draft_dir) / name):
        try:
            if src.exists():
                return src, src.read_bytes()
        except OSError as e:
            raise unreadable(src, e, what) from None
    return None


def read_tokenizer(target_dir, draft_dir, vocab_size: int) -> tuple[Path, bytes] | None:
    """The pair's ``tokenizer.json`` (the target's, else the draft's) → (its path, its bytes), checked
    by loading it as the runtime will; None when neither folder has one."""
    found = _pair_file(target_dir, draft_dir, "tokenizer.json", "tokenizer")
    if found is None:
        return None
    src, data = found
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # (tokenizers raises plain Exception; a bad encoding raises UnicodeDecodeError)
        raise CheckpointError(f"{src}: not a readable tokenizer.json ({str(e).strip()}); fix or remove it") from None
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"{src}: the tokenizer has token id {top}, outside the target's vocabulary "
                              f"[0, {vocab_size}): it is not this model's tokenizer")
    return found


def read_tokenizer_config(target_dir, draft_dir) -> tuple[Path, bytes] | None:
    """The pair's ``tokenizer_config.json`` (the target's, else the draft's: its ``chat_template``, special
    tokens) → (its path, its bytes), checked to be a JSON object whose ``chat_template``, if any, is a
    template or a list of named ones; None when neither folder has one."""
    found = _pair_file(target_dir, draft_dir, "tokenizer_config.json", "tokenizer config")
    if found is None:
        return None
    src, data = found
    try:
        config = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{src}: not a readable tokenizer_config.json ({e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{src}: a tokenizer_config.json must hold a JSON object, not "
                              f"{type(config).__name__}; fix or remove it")
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template)
    if template is not None and not isinstance(template, str) and not named:
        raise CheckpointError(f"{src}: chat_template must be a template (a string) or a list of "
                              f"{{\"name\", \"template\"}} objects; fix or remove it")
    return found


def check_out(out: Path, overwrite: bool) -> None:
    """The refusals about --out: not a link, and a folder that is missing, empty or an engine
    (replaced only with ``overwrite``)."""
    try:
        if out.is_symlink():
            raise BuildError(f"{out} is a symbolic link; give the folder it points to ({out.resolve()}) as --out")
        if not out.exists():
            return
        if not overwrite:
            raise FileExistsError(f"{out} exists")
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory; refusing to overwrite it")
        if any(out.iterdir()) and not (out / "manifest.json").is_file():
            raise FileExistsError(f"{out} exists and is not an engine directory; refusing to overwrite it")
    except OSError as e:
        if isinstance(e, FileExistsError) and e.errno is None:
            raise
        raise BuildError(f"cannot use {e.filename or out} as --out: {os_error_reason(e)}") from None


def _leftovers(out: Path, tag: str) -> list[Path]:
    prefix = f".{out.name}{tag}"
    try:
        return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def _remove(path: Path, log) -> None:
    def failed(_fn, p, exc):
        log(f"warning: could not remove {p}: {exc[1] if isinstance(exc, tuple) else exc}")

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=failed)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def recover(out: Path, log) -> None:
    """Under the lock: what a killed build into ``out`` left. An engine moved aside while ``out`` is
    missing (killed between the swap's two renames) is restored; temporary folders, engines moved
    aside and the ``<out>.partial`` of older builders are removed."""
    aside = _leftovers(out, ASIDE_TAG)
    if not out.exists() and not out.is_symlink():
        for p in sorted(aside, key=lambda p: p.stat().st_mtime, reverse=True):
            if (p / "manifest.json").is_file():
                os.rename(p, out)
                log(f"restored the engine a killed build had moved aside ({p.name} → {out.name})")
                aside.remove(p)
                break
    for p in _leftovers(out, TEMP_TAG) + aside + [out.with_name(out.name + ".partial")]:
        if p.exists() or p.is_symlink():
            log(f"removing {p.name}, left by a build that did not finish")
            _remove(p, log)


@contextlib.contextmanager
def out_lock(out: Path, log):
    """An exclusive ``flock`` on ``<out>.lock``: one build into ``out`` at a time; the others wait."""
    path = out.with_name(out.name + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise BuildError(f"cannot write beside --out: {e.filename or path}: {os_error_reason(e)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build into {out} to finish (it holds {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
            log("the other build finished; this one replaces its engine")
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _new_temp(out: Path) -> Path:
    """A new private folder beside ``out`` (made with the umask's mode, as ``out`` would be)."""
    while True:
        tmp = out.with_name(f".{out.name}{TEMP_TAG}{secrets.token_hex(4)}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


class _Signals:
    """While a build runs in the main thread: SIGTERM and SIGHUP (where they would just end the
    process) raise ``_Terminated`` so the build's ``finally`` removes its temporary folder, and then
    end the process as the signal would have; inside ``swap()`` they (and SIGINT) wait until the
    swap is done."""

    class _Terminated(BaseException):
        pass

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.saved: dict = {}
        self.swapping = False
        self.pending: int | None = None

    def _handler(self, signum, frame):
        if self.swapping:
            self.pending = signum
            return
        raise self._Terminated(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) == signal.SIG_DFL:
                    self.saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, kind, exc, tb):
        for sig, old in self.saved.items():
            signal.signal(sig, old)
        if isinstance(exc, self._Terminated):
            os.kill(os.getpid(), exc.args[0])  # (the default action again: the process ends here)
            raise SystemExit(128 + exc.args[0])
        return False

    @contextlib.contextmanager
    def swap(self):
        main = threading.current_thread() is threading.main_thread()
        old_int = signal.getsignal(signal.SIGINT) if main else None
        if main and old_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handler)
        self.swapping = True
        try:
            yield
        finally:
            self.swapping = False
            if main and old_int is signal.default_int_handler:
                signal.signal(signal.SIGINT, old_int)
            if self.pending is not None:
                signum, self.pending = self.pending, None
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                if signum in self.saved:
                    raise self._Terminated(signum)


def swap_in(tmp: Path, out: Path, log) -> None:
    """Rename the finished ``tmp`` to ``out``: an old engine is moved aside first and removed after;
    if the new one cannot be renamed in, the old one is put back."""
    aside = None
    if out.exists():
        aside = out.with_name(f".{out.name}{ASIDE_TAG}{secrets.token_hex(4)}")
        os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except BaseException:
        if aside is not None:
            os.rename(aside, out)
        raise
    if aside is not None:
        _remove(aside, log)


_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def build_engine(target_dir: str | Path, draft_dir: str | Path, out: str | Path, *, backend: str = "eager",
                 device: str = "cpu", max_batch: int = 8, max_seq: int = 1024, dtype: str | None = None,
                 overwrite: bool = True, quiet: bool = False, options: KernelOptions | None = None, tp: int = 1,
                 kv_cache_dtype: str | None = None, **aoti_options) -> dict:
    """Build an engine directory; returns its manifest. (The module's docstring: how ``out`` is
    replaced atomically, and how builds into one ``out`` are serialized.)

    ``options``: the kernel options the engine is built with and records; None: the environment's
    (``KernelOptions.from_env``: the kernel options' variables, read here once).
    ``kv_cache_dtype``: the target's KV cache, "auto" (the compute dtype) or "fp8" (E4M3 with the layers'
    scales: docs/fp8.md); None: as the target checkpoint says.
    ``aoti_options`` (backend ``aoti`` only): ``buckets``, ``prefill_chunk``, ``prefill_batch``, ``verify_widths``,
    ``sampling_controls``, ``fast_compile``, ``plugins``, ``jobs`` — see ``builder/aoti.py``."""
    options = KernelOptions.from_env() if options is None else options
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
    if "prefill_batch" in aoti_options:  # (refused before anything is loaded)
        from muse_spark.builder.aoti import check_prefill_batch

        check_prefill_batch(aoti_options["prefill_batch"], max_batch)
    if tp != 1 and backend not in ("eager", "aoti"):
        raise ValueError(f"--tp {tp}: tensor-parallel engines are eager or aoti engines (--backend eager|aoti)")
    if tp != 1 and aoti_options.get("kv_pool"):
        raise ValueError(f"--tp {tp}: a tensor-parallel aoti engine keeps a cache window per slot; build it without "
                         "--kv-cache-tokens")
    t0 = time.perf_counter()
    log = lambda m: _log(m, quiet)  # noqa: E731
    out = Path(out)
    check_out(out, overwrite)  # (again under the lock: a refusal now saves loading the checkpoints)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTDIR):
            raise BuildError(f"cannot create the folder of --out {out.parent}: a component of the path is not a "
                             f"directory{missing_note(out.parent)}") from None
        raise BuildError(f"cannot create the folder of --out {e.filename or out.parent}: {os_error_reason(e)}") from None
    if backend not in ("eager", "aoti") and any(load_config(d).quantization_config is not None
                                                for d in (target_dir, draft_dir)):
        raise BuildError(f"FP8 checkpoints (quantization_config) build eager and aoti engines (--backend eager|aoti); "
                         f"the {backend} engine's graphs of FP8 projections are not supported yet (docs/fp8.md)")
    if backend not in ("eager", "aoti") and (kv_cache_dtype == "fp8" or (
            kv_cache_dtype is None and load_config(target_dir).fp8_kv_cache)):
        raise BuildError(f"an FP8 KV cache builds eager and aoti engines (--backend eager|aoti); the {backend} "
                         "engine keeps its caches in the compute dtype (--kv-cache-dtype auto)")
    log(f"loading checkpoints {target_dir} + {draft_dir}")
    target, draft = load_pair(target_dir, draft_dir, dtype, "cpu", kv_cache_dtype)
    check_split(target.cfg, tp)  # (before anything is written)
    gamma = draft.cfg.block_size
    check_max_seq(target, draft, max_seq)
    dev = device_info(device)
    check_memory(target, draft, backend=backend, device=device, max_batch=max_batch, max_seq=max_seq)
    tokenizer = read_tokenizer(target_dir, draft_dir, target.cfg.vocab_size)
    tokenizer_config = read_tokenizer_config(target_dir, draft_dir)
    log("hashing checkpoint tensors")
    hashes = {"target": tensors_hash(target_dir), "draft": tensors_hash(draft_dir)}
    with _Signals() as signals, out_lock(out, log):
        try:
            recover(out, log)
        except OSError as e:
            raise BuildError(f"cannot clean up beside --out {out}: {e.filename}: {os_error_reason(e)}") from None
        check_out(out, overwrite)
        tmp = None
        try:
            tmp = _new_temp(out)
            with use_options(options):
                manifest = _write_engine(tmp, target, draft, target_dir, draft_dir, backend=backend, device=device,
                                         dev=dev, max_batch=max_batch, max_seq=max_seq, gamma=gamma, hashes=hashes,
                                         tokenizer=tokenizer, tokenizer_config=tokenizer_config, log=log,
                                         aoti_options=aoti_options, options=options, tp=tp)
            with signals.swap():
                swap_in(tmp, out, log)
        except OSError as e:
            if e.errno not in _WRITE_ERRNOS:
                raise
            where = e.filename or out
            raise BuildError(f"cannot write the engine {out}: {where}: {os_error_reason(e)}") from None
        finally:
            if tmp is not None and tmp.exists():
                _remove(tmp, log)
    log(f"engine written to {out} in {time.perf_counter() - t0:.1f}s")
    return manifest


def _write_engine(tmp: Path, target, draft, target_dir, draft_dir, *, backend, device, dev, max_batch, max_seq,
                  gamma, hashes, tokenizer, tokenizer_config, log, aoti_options, options: KernelOptions,
                  tp: int = 1) -> dict:
    """The engine's files and manifest, written into ``tmp``; → the manifest. ``tp`` > 1: the target as
    one weight file per tensor-parallel rank (``target.tp{r}.safetensors``: that rank's slice,
    ``muse_spark.sharding``), so a rank reads only its own."""
    log("writing engine weights")
    target_files = None
    if tp == 1:
        save_canonical(target, tmp / "target.safetensors")
    else:
        check_split(target.cfg, tp)
        sd = target.state_dict()
        target_files = [f"target.tp{r}.safetensors" for r in range(tp)]
        for r, name in enumerate(target_files):
            log(f"  rank {r}: {name}")
            save_file(shard_state_dict(sd, target.cfg, r, tp), str(tmp / name))
    save_canonical(draft, tmp / "draft.safetensors")
    aoti = embedding = trt = None
    if backend == "tensorrt":
        from muse_spark.builder.tensorrt import build_tensorrt

        trt = build_tensorrt(target, draft, tmp, max_batch=max_batch, max_seq=max_seq, log=log)
    if backend == "aoti" and tp != 1:
        # one set of packages every rank runs on its own slice (weights are graph inputs, and the slices share
        # their shapes), traced from rank 0's; no C++ embedding section: the C++ library runs one device
        from muse_spark.builder.aoti import build_aoti
        from muse_spark.sharding import shard_target, vocab_split

        log(f"compiling one rank's graphs (the slices of {tp} ranks share them)")
        aoti = build_aoti(shard_target(target, 0, tp, None), draft, tmp, device=device, max_batch=max_batch,
                          max_seq=max_seq, log=log, options=options,
                          tp={"world": tp, "vocab": vocab_split(target.cfg, tp)}, **aoti_options)
    elif backend == "aoti":
        from muse_spark.builder.aoti import build_aoti
        from muse_spark.builder.embedder import embedding_section

        aoti = build_aoti(target, draft, tmp, device=device, max_batch=max_batch, max_seq=max_seq, log=log,
                          options=options, **aoti_options)
        # (for the C++ embedding: the weights' sources, the parts' weights, the caches; derived.safetensors)
        embedding = embedding_section(target, draft, tmp, cache_slots=aoti["cache_slots"], max_seq=max_seq)
    tokenizer_name = None
    if tokenizer is not None:
        (tmp / "tokenizer.json").write_bytes(tokenizer[1])  # (the bytes that were checked)
        tokenizer_name = "tokenizer.json"
    tokenizer_config_name = None
    if tokenizer_config is not None:  # (the chat template and special tokens the OpenAI server reads)
        (tmp / "tokenizer_config.json").write_bytes(tokenizer_config[1])
        tokenizer_config_name = "tokenizer_config.json"
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
        # the kernel options it was built with (muse_spark/options.py; the runtime reads them back)
        "options": options.to_dict(),
        "tokenizer": tokenizer_name,
        "tokenizer_config": tokenizer_config_name,  # one of the hashed files, like the tokenizer
        "files": files,
    }
    if target_files:  # (runtime/tensor_parallel.py loads it; a single-device load refuses it)
        manifest["tensor_parallel"] = {"world": tp, "target_files": target_files}
    if aoti:
        manifest["aoti"] = aoti
    if embedding:
        manifest["embedding"] = embedding
    if trt:
        manifest["tensorrt"] = trt
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
