"""``muse-spark quantize``: a bf16/fp16/fp32 checkpoint → its FP8 (E4M3) checkpoint (docs/fp8.md).

    muse-spark quantize --target DIR --out DIR [--draft DIR --draft-out DIR] [--scheme per-channel|per-tensor]
        [--calibrate N | --calibration-prompts FILE]

What is quantized is what the loader reads as FP8 (``muse_spark.config.quantizable``): the decoder
layers' projections of the target and the draft, as the checkpoint names them (vLLM's unstacked
``q/k/v/o_gate/o_proj``, ``gate/up/down_proj``). Each becomes a ``float8_e4m3fn`` ``*.weight`` with a
float32 ``*.weight_scale``: per output channel (``[out, 1]``, the default) or per tensor (``[]``),
``scale = absmax / 448`` (448: E4M3's largest finite value; an all-zero row or tensor gets scale 1)
and ``weight = round_to_nearest_even(w / scale)``. Everything else is copied as it is: the other
tensors (embeddings, lm_heads, norms, residual gates, the draft's fc, Markov and confidence heads,
d2t), the tokenizer files and any other file; ``config.json`` gains ``quantization_config``
(quant_method ``fp8``, activation_scheme ``dynamic``, the other 2-D weights' modules in
``ignored_layers``, weight_block_size null). The output is sharded as the input (the same file
names, the index rewritten), converted one shard at a time: the host holds one shard and its
quantized copy, never the whole model. With calibration (``runtime/activation_scales.py``: the bf16 pair's
speculative decoding with every projection's input observed) each projection also gets a static ``input_scale``
(its largest input |x| / 448) and ``activation_scheme`` is ``static``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from muse_spark.checkpoint import INDEX_NAME, CheckpointError, TensorSource
from muse_spark.config import dtype_name, load_config, missing_note, quantizable
from muse_spark.models.layers import FP8, FP8_MAX  # float8_e4m3fn, 448

SCHEMES = ("per-channel", "per-tensor")
_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".weight_scale_inv")


class QuantizeError(ValueError):
    """A checkpoint that cannot be quantized as asked (already quantized, a missing input, an output that exists)."""


def quantize_weight(w: torch.Tensor, scheme: str = "per-channel") -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight → (float8_e4m3fn weight, float32 scale): per output channel [out, 1] or per tensor [],
    ``scale = absmax / 448`` (1 where absmax is 0), ``q = RNE(w / scale)``; ``q.float() * scale`` ≈ w."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    w32 = w.float()
    amax = w32.abs().amax(dim=1, keepdim=True) if scheme == "per-channel" else w32.abs().amax()
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.to(torch.float32).contiguous()


def _check_input(src: Path, what: str) -> dict:
    """The input checkpoint's config.json (parsed and validated as the loader does) → its raw dict."""
    try:
        if not src.is_dir():
            if src.exists():
                raise QuantizeError(f"--{what} {src} is not a directory")
            raise QuantizeError(f"--{what} {src}: no such checkpoint directory{missing_note(src)}")
    except OSError as e:
        raise QuantizeError(f"--{what} {src}: cannot read it ({e.strerror or e})") from None
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        raw = None  # (load_config below says what is wrong with it)
    if isinstance(raw, dict) and raw.get("quantization_config") is not None:
        qc = raw["quantization_config"]
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise QuantizeError(f"--{what} {src} is already quantized (its config.json has a quantization_config, "
                            f"quant_method {method!r}); quantize reads bf16, fp16 or fp32 checkpoints")
    load_config(src)  # (a missing or invalid config.json is an error naming the field)
    return raw


def _check_output(out: Path, src: Path, what: str, overwrite: bool) -> None:
    if out.resolve() == src.resolve():
        raise QuantizeError(f"--{what} {out} is the input checkpoint: write the FP8 checkpoint to another folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise QuantizeError(f"--{what} {out} exists and is not a directory")
        if not overwrite:
            raise QuantizeError(f"--{what} {out} exists: pass --overwrite to replace it, or choose another folder")


def _shards(source: TensorSource) -> list[tuple[Path, list[str]]]:
    """The input's files in order, each with the tensors it holds."""
    files: dict[Path, list[str]] = {}
    for name, path in source.where.items():
        files.setdefault(path, []).append(name)
    return sorted(files.items(), key=lambda kv: kv[0].name)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def quantize_checkpoint(src: str | Path, out: str | Path, *, scheme: str = "per-channel", overwrite: bool = False,
                        what: str = "target", log: Callable[[str], None] = print,
                        input_amax: dict[str, float] | None = None) -> dict:
    """Write the FP8 checkpoint of ``src`` into ``out`` → a summary (tensors quantized and copied, bytes).
    ``what``: the option naming the input in messages (``target``/``draft``). ``input_amax`` (per checkpoint
    module: its largest input |x|): static activation scales, each projection's ``input_scale`` = that / 448
    (float32 []), and ``activation_scheme`` ``static``; without it, dynamic (per-token scales at run time)."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    src, out = Path(src), Path(out)
    out_opt = "out" if what == "target" else f"{what}-out"
    raw = _check_input(src, what)
    _check_output(out, src, out_opt, overwrite)
    source = TensorSource(src)
    shards = _shards(source)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):  # (--overwrite: no shard of the old checkpoint is left)
        if old.is_file():
            old.unlink()
    weight_map: dict[str, str] = {}
    ignored: list[str] = []
    written: list[tuple[Path, Path]] = []
    n_quantized = n_copied = bytes_in = bytes_out = 0
    for i, (path, names) in enumerate(shards):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            for name in names:
                t = f.get_tensor(name)
                bytes_in += t.numel() * t.element_size()
                if t.dtype in (FP8, torch.float8_e5m2) or name.endswith(_SCALE_SUFFIXES):
                    raise QuantizeError(f"--{what} {src}: tensor {name!r} ({dtype_name(t.dtype)}) is already "
                                        "quantized; quantize reads bf16, fp16 or fp32 checkpoints")
                module, _, kind = name.rpartition(".")
                if kind == "weight" and quantizable(module):
                    if not t.is_floating_point() or t.dim() != 2:
                        raise QuantizeError(f"--{what} {src}: tensor {name!r} is {dtype_name(t.dtype)} of shape "
                                            f"{list(t.shape)}, expected a 2-D floating weight")
                    tensors[name], tensors[f"{module}.weight_scale"] = quantize_weight(t, scheme)
                    if input_amax is not None:
                        if module not in input_amax:
                            raise QuantizeError(f"--{what} {src}: calibration has no activation scale for {module}")
                        tensors[f"{module}.input_scale"] = torch.tensor(
                            max(input_amax[module] / FP8_MAX, torch.finfo(torch.float32).tiny), dtype=torch.float32)
                    n_quantized += 1
                else:
                    if kind == "weight" and t.dim() == 2 and module not in ignored:
                        ignored.append(module)
                    tensors[name] = t
                    n_copied += 1
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        bytes_out += size
        tmp = out / f".quantize-{path.name}.tmp"
        save_file(tensors, str(tmp), metadata=metadata)
        written.append((tmp, out / path.name))
        weight_map.update({n: path.name for n in tensors})
        n_q = sum(n.endswith(".weight_scale") for n in tensors)
        n_s = sum(n.endswith(".input_scale") for n in tensors)
        log(f"[quantize] {what}: {path.name} ({i + 1} of {len(shards)}): {n_q} projections → FP8, "
            f"{len(tensors) - 2 * n_q - n_s} tensors copied; "
            f"{_mib(path.stat().st_size)} → {_mib(tmp.stat().st_size)}")
        del tensors
    source.close()
    if n_quantized == 0:
        for tmp, _ in written:
            tmp.unlink()
        raise QuantizeError(f"--{what} {src}: no decoder-layer projection (q/k/v/o_gate/o_proj, gate/up/down_proj) "
                            "found to quantize")
    for tmp, final in written:
        os.replace(tmp, final)
    index = src / INDEX_NAME
    if index.is_file():
        meta = json.loads(index.read_text())
        meta["metadata"] = {**(meta.get("metadata") or {}), "total_size": bytes_out}
        meta["weight_map"] = dict(sorted(weight_map.items()))
        (out / INDEX_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    for entry in sorted(src.iterdir()):  # tokenizer files and whatever else the checkpoint holds
        if entry.name == "config.json" or entry.name == INDEX_NAME or entry.name.endswith(".safetensors"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
        elif entry.is_file():
            shutil.copy2(entry, out / entry.name)
    raw = dict(raw)
    scheme_a = "dynamic" if input_amax is None else "static"
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme_a, "ignored_layers": ignored,
                                  "weight_block_size": None}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")  # (last: a partial output does not load)
    seconds = time.perf_counter() - t0
    log(f"[quantize] {what} written to {out}: {n_quantized} projections in FP8 E4M3 ({scheme} scales), {scheme_a} "
        f"activation scales, "
        f"{n_copied} tensors copied; {_mib(bytes_in)} → {_mib(bytes_out)} of tensors in {seconds:.1f}s")
    return {"out": str(out), "scheme": scheme, "quantized": n_quantized, "copied": n_copied, "bytes_in": bytes_in,
            "bytes_out": bytes_out, "shards": len(shards), "seconds": seconds}


def quantize_pair(target: str | Path, out: str | Path, *, draft: str | Path | None = None,
                  draft_out: str | Path | None = None, scheme: str = "per-channel", overwrite: bool = False,
                  log: Callable[[str], None] = print,
                  measure_input_amax: Callable[[], dict[str, dict[str, float]]] | None = None) -> dict:
    """``muse-spark quantize``: the target (and the draft, when given) → FP8. Every input and output is
    checked before anything is written. ``measure_input_amax``: called once the inputs and outputs are checked →
    {"target": …, "draft": …}, each {checkpoint module: its largest input |x|} (the runtime's
    ``activation_scales.measure_input_amax`` on the bf16 pair, which runs the draft too, so ``draft`` is needed):
    static activation scales; else dynamic. → {"target": summary, "draft": summary or None}."""
    if (draft is None) != (draft_out is None):
        raise QuantizeError("--draft and --draft-out must be given together")
    if measure_input_amax is not None and draft is None:
        raise QuantizeError("--calibrate runs the pair's speculative decoding to measure activation scales: it "
                            "needs --draft and --draft-out")
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    jobs = [("target", Path(target), Path(out))]
    if draft is not None:
        jobs.append(("draft", Path(draft), Path(draft_out)))
        if Path(out).resolve() == Path(draft_out).resolve():
            raise QuantizeError(f"--out and --draft-out are the same folder {out}")
    for what, src, dst in jobs:
        _check_input(src, what)
        _check_output(dst, src, "out" if what == "target" else "draft-out", overwrite)
    try:
        amax = measure_input_amax() if measure_input_amax is not None else {}
        return {what: quantize_checkpoint(src, dst, scheme=scheme, overwrite=overwrite, what=what, log=log,
                                          input_amax=amax.get(what))
                for what, src, dst in jobs} | ({} if draft is not None else {"draft": None})
    except CheckpointError as e:
        raise QuantizeError(str(e)) from None
