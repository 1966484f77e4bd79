"""``muse-spark triton-repo``: engine directory → Triton model repository.

    REPO/
      <model>/                  (muse_spark by default)
        config.pbtxt            python backend, decoupled, tensors from protocol.py
        1/model.py              a copy of muse_spark/serving/model.py

The repository refers to the engine by absolute path (``engine_dir``
parameter) instead of copying its weights. ``max_batch_size`` is 1: each
Triton request is one prompt (the shape tensorrtllm_backend clients send,
``[1, …]``); batching happens *inside* the model, across requests, at every
speculative step. Serve it with ``muse-spark serve --repo REPO``, which
provides the python stub and environment the model needs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from muse_spark.serving.server import add_kv_pool_arguments, kv_pool

MODEL_TEMPLATE = Path(__file__).with_name("model.py")
MARKER = "# written by muse-spark triton-repo"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


class RepoError(ValueError):
    """A model repository that cannot be written; the message says why."""


def _tensor(spec) -> str:  # a protocol.TensorSpec
    dims = ", ".join(str(d) for d in spec.dims)
    opt = "\n    optional: true" if spec.optional else ""
    return f'  {{\n    name: "{spec.name}"\n    data_type: {spec.dtype}\n    dims: [ {dims} ]{opt}\n  }}'


def _param(key: str, value) -> str:
    return f'parameters: {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}'


def render_config(model_name: str, engine_dir: Path, *, instances: int = 1, kind: str = "KIND_CPU",
                  max_queue: int = 256, device: str | None = None, torch_threads: int | None = None,
                  prefix_cache_mib: float = 0, tp: int = 1, kv_pool: dict | None = None) -> str:
    """The text of config.pbtxt."""
    from muse_spark.serving.protocol import INPUTS, OUTPUTS  # imports torch (via the runtime): keep it lazy

    params = [_param("engine_dir", engine_dir.as_posix()), _param("max_queue", max_queue)]
    if prefix_cache_mib:
        params.append(_param("prefix_cache_mib", prefix_cache_mib))
    if device:
        params.append(_param("device", device))
    if torch_threads:
        params.append(_param("torch_threads", torch_threads))
    if tp > 1:
        params.append(_param("tp", tp))
    kv_pool = kv_pool or {}
    if "kv_memory_fraction" in kv_pool or "kv_tokens" in kv_pool:
        size = (_param("kv_cache_memory_fraction", kv_pool["kv_memory_fraction"]) if "kv_memory_fraction" in kv_pool
                else _param("kv_cache_tokens", kv_pool["kv_tokens"]))
        params += [size, _param("kv_block_size", kv_pool["kv_block_size"])]
    if "swap_space" in kv_pool:
        params.append(_param("swap_space", kv_pool["swap_space"]))
    return "\n".join([
        MARKER,
        f'name: "{model_name}"',
        'backend: "python"',
        "max_batch_size: 1",
        "model_transaction_policy {\n  decoupled: true\n}",
        "input [\n" + ",\n".join(_tensor(s) for s in INPUTS) + "\n]",
        "output [\n" + ",\n".join(_tensor(s) for s in OUTPUTS) + "\n]",
        f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]",
        *params,
    ]) + "\n"


def write_repository(engine_dir: str | Path, out: str | Path, *, model_name: str = "muse_spark",
                     instances: int = 1, max_queue: int = 256, device: str | None = None,
                     torch_threads: int | None = None, prefix_cache_mib: float = 0, tp: int | None = None,
                     kv_pool: dict | None = None) -> Path:
    """Write (or replace) model ``model_name`` in repository ``out``; → the model directory. ``tp`` (default: the
    ranks the engine was built for, else 1) > 1: the
    model runs the engine's target split over that many ranks (rank 0 in the model, the others started by
    ``muse-spark serve``; an eager engine, one instance).

    Other models already in ``out`` are left alone; a model directory of the same
    name is replaced only if this command wrote it.
    """
    from muse_spark.engine_format import read_manifest, tp_world  # imports torch: keep the CLI parser light

    if not _NAME_RE.match(model_name):
        raise RepoError(f"model name {model_name!r} must be letters, digits, '_', '.', '-'")
    if instances < 1:
        raise RepoError(f"--instances must be >= 1, got {instances}")
    if max_queue < 1:
        raise RepoError(f"--max-queue must be >= 1, got {max_queue}")
    if device is not None and not _DEVICE_RE.match(device):
        raise RepoError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if torch_threads is not None and torch_threads < 1:
        raise RepoError(f"--torch-threads must be >= 1, got {torch_threads}")
    if not prefix_cache_mib >= 0:
        raise RepoError(f"--prefix-cache-mib must be >= 0, got {prefix_cache_mib}")
    engine_dir = Path(engine_dir).resolve()
    manifest = read_manifest(engine_dir)  # a clear error now rather than at model load
    split = tp_world(manifest)
    if tp is None:  # (an engine built for ranks is served over them)
        tp = split
    if tp == 1 and split != 1:
        raise RepoError(f"this engine is split for {split} ranks: give --tp {split}")
    if tp != 1:
        from muse_spark.sharding import TensorParallelError, check_engine_split

        if tp < 1:
            raise RepoError(f"--tp must be >= 1, got {tp}")
        if instances != 1:
            raise RepoError(f"--tp {tp} runs one model instance (its ranks are the parallelism), not {instances}")
        try:
            check_engine_split(manifest, tp, engine_dir)
        except TensorParallelError as e:
            raise RepoError(str(e)) from None
    dev = device or manifest.get("device", {}).get("kind", "cpu")
    kind = "KIND_GPU" if str(dev).startswith("cuda") else "KIND_CPU"

    out = Path(out)
    model_dir = out / model_name
    if model_dir.exists():
        cfg = model_dir / "config.pbtxt"
        if not (cfg.is_file() and cfg.read_text().startswith(MARKER)):
            raise RepoError(f"{model_dir} exists and was not written by muse-spark triton-repo; refusing to replace it")
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(MODEL_TEMPLATE, model_dir / "1" / "model.py")
    (model_dir / "config.pbtxt").write_text(
        render_config(model_name, engine_dir, instances=instances, kind=kind, max_queue=max_queue, device=device,
                      torch_threads=torch_threads, prefix_cache_mib=prefix_cache_mib, tp=tp, kv_pool=kv_pool))
    return model_dir


# ---- command line ---------------------------------------------------------------------------
def add_triton_repo_command(sub) -> None:
    r = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for an engine")
    r.add_argument("--engine", required=True, help="engine directory (from `muse-spark build`)")
    r.add_argument("--out", required=True, help="model repository directory to write into")
    r.add_argument("--model-name", default="muse_spark")
    r.add_argument("--instances", type=int, default=1, help="model instances (each loads the engine)")
    r.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before new ones "
                                                               "are refused (UNAVAILABLE)")
    r.add_argument("--device", default=None, help="override the engine's device (cpu, cuda, cuda:1)")
    r.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads per instance (default: torch's, one per core); on a CPU shared with other "
                        "work, fewer threads avoid OpenMP oversubscription, which can slow steps 10-50x")
    r.add_argument("--prefix-cache-mib", type=float, default=0,
                   help="memory (MiB) for stored prompt prefixes: a request starting with one skips its prefill "
                        "(default 0: none)")
    r.add_argument("--tp", type=int, default=None, metavar="N",
                   help="split the target over N ranks (an eager engine; `muse-spark serve` starts ranks 1 … N-1, "
                        "the model is rank 0). Default: the ranks the engine was built for (build --tp N), else 1")
    add_kv_pool_arguments(r)
    r.set_defaults(fn=cmd_triton_repo)


def cmd_triton_repo(a) -> int:
    model_dir = write_repository(a.engine, a.out, model_name=a.model_name, instances=a.instances,
                                 max_queue=a.max_queue, device=a.device, torch_threads=a.torch_threads,
                                 prefix_cache_mib=a.prefix_cache_mib, tp=a.tp, kv_pool=kv_pool(a))
    print(f"model repository: {Path(a.out)} (model {a.model_name!r} in {model_dir}); "
          f"serve it with: muse-spark serve --repo {a.out}")
    return 0
