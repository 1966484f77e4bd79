"""Kernel options: every build and run switch of the kernels and engines, in one frozen object.

``KernelOptions`` holds them, typed, each with its default and why it is the default
(``describe()`` lists them; docs/design.md, "Kernel options", has the table).
``KernelOptions.from_env`` is the one place the ``MUSE_SPARK_*`` environment variables are read: the
entry points (``muse-spark build``, loading an engine, an eager engine from checkpoints) turn the
environment into options there, once, and pass the object on.

How the options reach the code that reads them:

* the builder takes a ``KernelOptions``, records it in the engine's manifest (``"options"``, a dict)
  and compiles every graph under it: each compile job carries the dict and the worker traces inside
  ``use_options``;
* the runtime reads them back from the manifest (``engine_options``; an engine built without the
  key gets the defaults, which are what such an engine was built with) and runs its eager paths
  under ``use_options``;
* the models and plugins read ``current_options()``: the options of the innermost ``use_options``
  block of this thread or task (a ``contextvars.ContextVar``), the defaults outside any. Nothing
  writes ``os.environ``. Under ``torch.compile`` the options are a trace-time constant, as the
  environment variables were (dynamo cannot trace a ``ContextVar``).

Two scopes: ``build`` options change what is traced and compiled (an engine runs with the ones it
was built with); ``run`` options are choices of the runtime (the same packages and results either
way), which loading an engine may take from the environment or the caller.

This module is the bottom layer: it imports neither the models, the plugins, the builder nor the
runtime (nor torch).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping

_log = logging.getLogger(__name__)

ENV_PREFIX = "MUSE_SPARK_"
# Not a kernel option: ``muse-spark serve`` names a file in it for its model process (serving/model.py,
# which reads it; a process-internal handshake, documented there).
SERVE_DRAIN_FILE_ENV = ENV_PREFIX + "SERVE_DRAIN_FILE"


def serve_drain_file(environ: Mapping[str, str] = os.environ) -> str | None:
    """The drain file ``muse-spark serve`` named for its model process (``SERVE_DRAIN_FILE_ENV``), or None."""
    return environ.get(SERVE_DRAIN_FILE_ENV) or None


# The rendezvous port `muse-spark serve` hands a model split over tensor-parallel ranks (its rank 0).
SERVE_TP_PORT_ENV = ENV_PREFIX + "TP_PORT"


def serve_tp_port(environ: Mapping[str, str] = os.environ) -> int | None:
    """The port rank 0 of a tensor-parallel model joins its other ranks on (``SERVE_TP_PORT_ENV``), or None."""
    value = environ.get(SERVE_TP_PORT_ENV)
    return int(value) if value else None

# Not kernel options: the build cache of compiled packages (builder/package_cache.py), its folder (or "off") and
# its size limit in GiB.
BUILD_CACHE_ENV = ENV_PREFIX + "BUILD_CACHE"
BUILD_CACHE_GB_ENV = ENV_PREFIX + "BUILD_CACHE_GB"


def build_cache_setting(environ: Mapping[str, str] = os.environ) -> str | None:
    """The build cache's folder or ``off`` as ``BUILD_CACHE_ENV`` sets it, or None (unset or empty)."""
    return environ.get(BUILD_CACHE_ENV) or None


def build_cache_limit_gb(environ: Mapping[str, str] = os.environ) -> float | None:
    """The build cache's size limit in GiB (``BUILD_CACHE_GB_ENV``), or None; a value that is not a positive
    number is refused, naming the variable."""
    value = environ.get(BUILD_CACHE_GB_ENV)
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise OptionsError(f"{BUILD_CACHE_GB_ENV}={value!r}: expected a positive number of GiB")
    return gb


ATTENTION_KERNELS = ("triton", "sdpa")
LINEAR_KERNELS = ("triton", "cublas")
SCOPES = ("build", "run")


class OptionsError(ValueError):
    """A kernel option that cannot be taken: the message names the variable or key and the allowed values."""


def _option(default, env: str, doc: str, scope: str = "build", choices: tuple | None = None):
    return field(default=default, metadata={"env": ENV_PREFIX + env, "doc": doc, "scope": scope, "choices": choices})


@dataclass(frozen=True)
class KernelOptions:
    """The kernel and engine switches (each field's ``metadata``: its variable, scope and doc)."""

    attention: str = _option(
        "triton", "ATTENTION",
        "The fused attention in bf16/fp16 on CUDA: `triton` (plugins/attention: split-KV, the cache rows read in place, "
        "unseen key tiles skipped) or `sdpa`. Triton: 9.6 / 39.7 / 101.6 against SDPA's 58.3 / 112.8 / 295.1 µs a layer "
        "at batch 1 / 8 / 32 on the H200 (2026-12-02).", choices=ATTENTION_KERNELS)
    linear: str = _option(
        "triton", "LINEAR",
        "The GEMM of linear layers with at most 16 rows in bf16/fp16 on CUDA: `triton` (the skinny kernel, silu·mul "
        "fused into the gate/up projection) or `cublas`. Triton: the batch-1 step 5.95 against 6.10 ms "
        "(H200, 2026-12-03).", choices=LINEAR_KERNELS)
    attention_cache: bool = _option(
        True, "ATTENTION_CACHE",
        "One kernel norms and rotates q/k, writes the K/V caches and attends (`muse_spark::attention_cache_triton`), "
        "where the q/k norm kernel would write the caches and the Triton attention runs: 11.48 against 12.34 µs a "
        "layer, the step graph 0.992 × (H200, 2026-12-03). Without `rope_table` it is slower than the two kernels: "
        "turn both off for the two-kernel path.")
    rope_table: bool = _option(
        True, "ROPE_TABLE",
        "The qkv projection's launch also writes the step's RoPE cos/sin table, which the q/k norm kernel (or the "
        "fused attention) reads instead of computing the angles: the same bits, the norm kernel 4.17 → 2.01 µs a "
        "layer, the step graph 0.988–0.990 × (H200, 2026-12-03).")
    attention_splits: int = _option(
        0, "ATTENTION_SPLITS",
        "Splits of the key window one program of the attention's partial kernel runs in turn: 0, the launcher's "
        "choice by the grid's size (one a program up to batch 3 at the step's shape, more from batch 4); N > 0: N. "
        "Every value gives the same bits; the launcher's choice made the step 1.062 × / 1.154 × faster at batch "
        "8 / 32 than one split a program (H200, 2026-12-05).")
    accept_kernels: bool = _option(
        True, "ACCEPT_KERNELS",
        "A Triton build's step_verify runs the acceptance rule in three Triton kernels (`muse_spark::accept_triton`) "
        "instead of Inductor's compile of the reference (~20 kernels): 19.2 against ≈ 45 µs a batch-1 step "
        "(H200, 2026-12-04).")
    pdl: bool = _option(
        True, "PDL",
        "Programmatic dependent launch on sm_90 and newer: the plugin kernels compile with the PDL wait first and "
        "the step graphs launch them as programmatic dependents of the kernel before. With `pdl_trigger` the "
        "batch-1 step graph 0.987–0.989 × the one without, in turns (H200, 2026-12-04).")
    pdl_trigger: bool = _option(
        True, "PDL_TRIGGER",
        "With `pdl`: the kernels that are not GEMMs (gated residual, q/k norm, attention) trigger their dependents' "
        "launch first, then wait, so the GEMM after one is placed and waiting while it runs. Waiting only was "
        "0.999 × the step without PDL, triggering 0.987–0.989 × (H200, 2026-12-04).")
    pdl_gemm_trigger: bool = _option(
        True, "PDL_GEMM_TRIGGER",
        "With `pdl`: the skinny GEMMs trigger their dependents' launch after their weight stream, before their "
        "stores (ordered through the stores' mask, so Inductor adds no copies): 0.997 × the GEMMs waiting only, "
        "in turns, in two runs (H200, 2026-12-04).")
    context_stream: bool = _option(
        True, "CONTEXT_STREAM",
        "An aoti engine on CUDA runs each step's draft context K/V on a second stream, beside the target layers after "
        "the last aux layer and the verification: the same packages and results; 0–1.1 % faster at batch 1, "
        "≈ 0.5 % at batch 8 / 32 (H200, 2026-12-04).", scope="run")
    chained_steps: bool = _option(
        True, "CHAINED_STEPS",
        "The Generator launches each step of an aoti engine before it reads the rows of the step before (the same "
        "output, token for token), so the device does not wait for the host between steps: 5.36 ms a step "
        "(H200, 2026-12-04); off, it waits for every step's rows.", scope="run")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata["choices"]
            if choices is not None:
                if not isinstance(value, str) or value not in choices:
                    raise OptionsError(f"kernel option {f.name}={value!r}: expected one of {list(choices)}")
            elif f.type in (bool, "bool"):
                if not isinstance(value, bool):
                    raise OptionsError(f"kernel option {f.name}={value!r}: expected true or false")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise OptionsError(f"kernel option {f.name}={value!r}: expected 0 (the launcher's choice) or a "
                                   "count ≥ 1")

    # ---- from and to the environment, dicts and manifests ---------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: KernelOptions | None = None,
                 scope: str | None = None) -> KernelOptions:
        """The options the ``MUSE_SPARK_*`` variables of ``environ`` (default: ``os.environ``) give, each
        field whose variable is unset taken from ``base`` (default: the defaults); ``scope``: only the
        fields of that scope are read. A value that is not one the field takes is refused, naming the
        variable and the allowed values (the choices case-insensitively; switches ``0`` or ``1``;
        ``ATTENTION_SPLITS`` a count ≥ 0), never read as another."""
        if scope is not None and scope not in SCOPES:
            raise ValueError(f"unknown option scope {scope!r} (expected one of {list(SCOPES)})")
        environ = os.environ if environ is None else environ
        base = cls() if base is None else base
        values = {}
        for f in fields(cls):
            name = f.metadata["env"]
            if (scope is not None and f.metadata["scope"] != scope) or name not in environ:
                continue
            raw = environ[name]
            choices = f.metadata["choices"]
            if choices is not None:
                value = raw.strip().lower()
                if value not in choices:
                    raise OptionsError(f"{name}={value!r}: expected one of {list(choices)}")
            elif f.type in (bool, "bool"):
                value = raw.strip()
                if value not in ("0", "1"):
                    raise OptionsError(f"{name}={value!r}: expected 0 or 1")
                value = value == "1"
            else:
                value = raw.strip()
                if not value.isdigit():
                    raise OptionsError(f"{name}={value!r}: expected 0 (the launcher's choice) or a count ≥ 1")
                value = int(value)
            values[f.name] = value
        return dataclasses.replace(base, **values)

    def to_dict(self) -> dict[str, Any]:
        """The options as a JSON-able dict (the manifest's ``"options"``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "options") -> KernelOptions:
        """The options ``to_dict`` wrote; a key it does not know, or a value of the wrong type, is
        refused naming it (``where``: what the dict is, for the message). Missing keys: the defaults."""
        if not isinstance(data, Mapping):
            raise OptionsError(f"{where}: expected a dict of kernel options, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OptionsError(f"{where}: unknown kernel option(s) {unknown} (this muse-spark knows {sorted(known)})")
        try:
            return cls(**data)
        except OptionsError as e:
            raise OptionsError(f"{where}: {e}") from None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], where: str = "engine") -> KernelOptions:
        """The options an engine was built with (its manifest's ``"options"``); an engine whose manifest
        has none was built before they were recorded, with the defaults."""
        data = manifest.get("options")
        return cls() if data is None else cls.from_dict(data, f"{where}: manifest options")

    # ---- views --------------------------------------------------------------------------------------
    def changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults, by name."""
        default = KernelOptions()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def with_run(self, other: KernelOptions) -> KernelOptions:
        """These options with ``other``'s run-scope fields."""
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in fields(self)
                                            if f.metadata["scope"] == "run"})

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """One row per field: name, type, default, variable, scope, allowed values, doc."""
        return [{"name": f.name, "type": f.type if isinstance(f.type, str) else f.type.__name__,
                 "default": f.default, "env": f.metadata["env"], "scope": f.metadata["scope"],
                 "choices": f.metadata["choices"], "doc": f.metadata["doc"]} for f in fields(cls)]


DEFAULT_OPTIONS = KernelOptions()

_CURRENT: contextvars.ContextVar[KernelOptions] = contextvars.ContextVar("muse_spark_kernel_options",
                                                                        default=DEFAULT_OPTIONS)


def current_options() -> KernelOptions:
    """The options in effect: those of the innermost ``use_options`` block of this thread or task; the
    defaults outside any. (Under ``torch.compile``: those of the trace, taken as a constant.)"""
    return _CURRENT.get()


# dynamo cannot trace ContextVar.get: marked as ``torch.compiler.assume_constant_result`` marks a
# function (the attribute it sets), without importing torch._dynamo here (it imports Triton), so a
# compiled graph reads the options of its trace (tests/test_options.py checks it compiles)
current_options._dynamo_marked_constant = True


@contextlib.contextmanager
def use_options(options: KernelOptions) -> Iterator[KernelOptions]:
    """Make ``options`` the ones the models and plugins read (``current_options``) for the block: the
    builder around each graph's trace and compile, the engines around their eager calls. Scoped to
    this thread or task (a new thread starts with the defaults) and undone on exit."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"use_options takes a KernelOptions, got {type(options).__name__}")
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)


def engine_options(manifest: Mapping[str, Any], options: KernelOptions | None = None,
                   environ: Mapping[str, str] | None = None, where: str = "engine") -> KernelOptions:
    """The options an engine runs with: the build-scope fields always its manifest's (``from_manifest``:
    what its packages were compiled with); the run-scope fields ``options``' where given, else the
    manifest's, each overridden by its variable where ``environ`` (default: ``os.environ``) sets it
    (so ``MUSE_SPARK_CHAINED_STEPS=0 muse-spark generate …`` still turns chained steps off)."""
    built = KernelOptions.from_manifest(manifest, where)
    if options is not None:
        return built.with_run(options)
    environ = os.environ if environ is None else environ
    ignored = []
    for f in fields(KernelOptions):
        name = f.metadata["env"]
        if f.metadata["scope"] == "build" and name in environ:
            try:
                differs = getattr(KernelOptions.from_env({name: environ[name]}, base=built), f.name) != getattr(built, f.name)
            except OptionsError:
                differs = True
            if differs:
                ignored.append(name)
    if ignored:
        _log.warning("%s: ignoring %s from the environment: an engine runs with the build options it was built "
                     "with (rebuild it to change them)", where, ", ".join(ignored))
    return KernelOptions.from_env(environ, base=built, scope="run")
