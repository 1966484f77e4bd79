"""Checkpoint loading: HF-style safetensors → the reference modules.

* safetensors only, one file or sharded with ``model.safetensors.index.json``;
  pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are refused;
* vLLM's Muse Spark DSpark names and stacking: ``q/k/v/o_gate_proj`` → ``qkv_proj``,
  ``gate/up_proj`` → ``gate_up_proj``; for the draft ``d2t`` →
  ``draft_id_to_target_id``, ``t2d`` ignored, ``embed_tokens``/``mask_embedding``
  dropped, ``model.`` prefixed to everything but ``lm_head``; vLLM's errors
  when ``lm_head`` or ``d2t`` is missing;
* every missing, unexpected or misshaped tensor is an error naming the tensor
  with its expected and actual shape; NaN/Inf in weights is reported;
* dtypes are checked, not converted silently: every floating weight must have the
  config's ``torch_dtype`` (vectors — norm weights, residual gates, biases — may also
  be float32), so an int8 or fp16 ``q_proj`` in a bf16 checkpoint is refused with its
  name and dtypes; ``d2t`` must be an integer tensor. ``--dtype`` then converts the
  checked weights (it overrides the compute dtype, not what the files must hold);
* FP8 (E4M3) checkpoints (docs/fp8.md; ``quantization_config`` with quant_method ``fp8``): the
  decoder layers' projections are ``float8_e4m3fn`` ``*.weight`` with float32 (or exactly widened
  bf16/fp16) ``*.weight_scale`` per tensor ([] or [1]) or per output channel ([out, 1] or [out]),
  and with ``activation_scheme`` ``static`` a scalar ``*.input_scale``. They stay FP8: the module
  becomes an ``Fp8Linear`` holding the FP8 weight and float32 per-channel scales [out, 1] (a
  per-tensor scale expanded; stacking q/k/v/o_gate or gate/up stacks the parts' scales, so parts
  with different per-tensor scales keep them; stacked input scales: the largest). Everything else
  keeps the rules above; an FP8 tensor anywhere else, a projection of the wrong dtype, a missing or
  misshaped scale, non-positive or non-finite scales, NaN weights and block-wise scales are errors
  naming the tensor;
* an FP8 KV cache (the target's ``kv_cache_dtype`` ``"fp8"``: a ``kv_cache_scheme`` in its
  ``quantization_config``, or ``--kv-cache-dtype fp8``): each layer's ``self_attn.k_scale`` and
  ``self_attn.v_scale``, float32 (bf16/fp16 widened) per layer ([] or [1]) or per KV head ([KV]),
  positive and finite, held as float32 [KV]. Required where the checkpoint declares the scheme; 1 where
  the option asks for an FP8 cache and the checkpoint has none; ignored where the cache is not FP8;
* a file or folder that cannot be read (permission denied, a folder where a file
  should be, …) is a ``CheckpointError`` naming the path and the reason;
* memory: safetensors maps the files; tensors are converted one at a time and
  assigned into modules built on the meta device (``load_state_dict(assign=True)``),
  so the process never holds two full copies of the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from muse_spark.config import (QUANTIZABLE_STACKED, MuseSpark1xConfig, MuseSparkDSparkConfig, dtype_name, load_config,
                               missing_note, os_error_reason, parse_dtype, quantizable)
from muse_spark.models.draft import MuseSparkDSparkForCausalLM
from muse_spark.models.layers import FP8, Fp8Linear
from muse_spark.models.target import MuseSpark1xForCausalLM

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says which file/tensor and why."""


def unreadable(path: str | Path, e: OSError, what: str = "") -> CheckpointError:
    """The error for a file-system call that failed on ``path`` (``e.filename`` when it names another)."""
    where = e.filename if isinstance(e.filename, str) and e.filename else str(path)
    return CheckpointError(f"cannot read {what + ' ' if what else ''}{where}: {os_error_reason(e)}")


def check_readable_file(path: str | Path, what: str = "") -> None:
    """Open ``path`` for reading once, so a permission problem or a folder in place of the file is
    reported as what it is (safetensors reports an unreadable file as missing)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise unreadable(path, e, what) from None


# ---- raw tensor access ------------------------------------------------------------------
class TensorSource:
    """Lazily reads named tensors from one safetensors file or a sharded set."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        try:
            if not self.dir.is_dir():
                if self.dir.exists():
                    raise CheckpointError(f"checkpoint directory {self.dir} is not a directory")
                raise CheckpointError(f"checkpoint directory {self.dir} does not exist{missing_note(self.dir)}")
            # (listed here, not globbed: a glob takes an unreadable folder for an empty one)
            entries = sorted(os.listdir(self.dir))
        except OSError as e:
            raise unreadable(self.dir, e, "checkpoint directory") from None
        index = self.dir / INDEX_NAME
        self.where: dict[str, Path] = {}
        if INDEX_NAME in entries:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except OSError as e:
                raise unreadable(index, e) from None
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: malformed index (weight_map is not an object)")
            checked: set[Path] = set()
            for name, shard in weight_map.items():
                path = self.dir / str(shard)
                if path not in checked:
                    if not path.exists():
                        raise CheckpointError(f"{index}: tensor {name!r} points to missing shard {shard!r}")
                    check_readable_file(path, "checkpoint shard")
                    checked.add(path)
                self.where[name] = path
        else:
            files = [self.dir / n for n in entries if n.endswith(".safetensors")]
            if not files:
                pickles = [n for n in entries if Path(n).suffix in PICKLE_SUFFIXES]
                if pickles:
                    raise CheckpointError(
                        f"{self.dir}: pickle checkpoints are refused (found {pickles}); "
                        "only safetensors can be loaded safely — convert the weights first"
                    )
                raise CheckpointError(f"{self.dir}: no *.safetensors files")
            for path in files:
                for name in self._keys(path):
                    if name in self.where:
                        raise CheckpointError(f"{self.dir}: tensor {name!r} appears in two files")
                    self.where[name] = path
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        check_readable_file(path, "checkpoint file")
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        path = self.where[name]
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt")
            return self._handles[path].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._handles.clear()


# ---- expected canonical shapes --------------------------------------------------------
def _layer_shapes(cfg: MuseSpark1xConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    s = {
        f"{prefix}.self_attn.qkv_proj.weight": (cfg.qkv_out, d),
        f"{prefix}.self_attn.o_proj.weight": (d, cfg.q_size),
        f"{prefix}.feed_forward.gate_up_proj.weight": (2 * f, d),
        f"{prefix}.feed_forward.down_proj.weight": (d, f),
        f"{prefix}.attn_residual_gate": (d,),
        f"{prefix}.ffn_residual_gate": (d,),
    }
    if cfg.norm_affine:
        for n in ("self_attn.pre_qkv_proj_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm"):
            s[f"{prefix}.{n}.weight"] = (d,)
    return s


def expected_shapes(cfg: MuseSpark1xConfig) -> dict[str, tuple[int, ...]]:
    """Canonical (stacked) tensor names → shapes for the target or the draft."""
    d = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        s.update(_layer_shapes(cfg, f"model.layers.{i}"))
    if cfg.norm_affine:
        s["model.norm.weight"] = (d,)
    if isinstance(cfg, MuseSparkDSparkConfig):
        r = cfg.markov_rank
        s["model.fc.weight"] = (d, cfg.target_hidden_size * len(cfg.target_layer_ids))
        if cfg.norm_affine:
            s["model.hidden_norm.weight"] = (d,)
        s["model.markov_head.markov_w1.weight"] = (cfg.vocab_size, r)
        s["model.markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, r)
        if r and cfg.markov_head_type == "gated":
            s["model.markov_head.gate_proj.weight"] = (r, d + r)
            s["model.markov_head.gate_proj.bias"] = (r,)
        if r and cfg.markov_head_type == "rnn":
            s["model.markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            s["model.markov_head.joint_proj.bias"] = (3 * r,)
        if cfg.enable_confidence_head:
            w = d + (r if cfg.confidence_head_with_markov else 0)
            s["model.confidence_head.proj.weight"] = (1, w)
            s["model.confidence_head.proj.bias"] = (1,)
        s["lm_head.weight"] = (cfg.draft_vocab_size, d)
        s["draft_id_to_target_id"] = (cfg.draft_vocab_size,)
    else:
        s["model.embed_tokens.weight"] = (cfg.vocab_size, d)
        if not cfg.tie_word_embeddings:
            s["lm_head.weight"] = (cfg.vocab_size, d)
    static = cfg.quantization_config is not None and cfg.quantization_config.static
    for module in fp8_projections(cfg):
        s[f"{module}.weight_scale"] = (s[f"{module}.weight"][0], 1)
        if static:
            s[f"{module}.input_scale"] = ()
    if cfg.fp8_kv_cache:
        for i in range(cfg.num_hidden_layers):
            for kind in KV_SCALES:
                s[f"model.layers.{i}.self_attn.{kind}"] = (cfg.num_key_value_heads,)
    return s


KV_SCALES = ("k_scale", "v_scale")  # an FP8 KV cache's per-layer scales (``self_attn.k_scale``/``v_scale``)
_KV_SCALE_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_scale$")


def _kv_scale(directory, ck: str, t: torch.Tensor, cfg: MuseSpark1xConfig) -> torch.Tensor:
    """A layer's ``k_scale``/``v_scale`` → float32 [KV] (a per-layer scale expanded over the KV heads)."""
    kv = cfg.num_key_value_heads
    if t.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{directory}: tensor {ck!r} has dtype {dtype_name(t.dtype)}, expected float32 "
                              "(KV-cache scales are float32; bfloat16 and float16 are widened exactly)")
    if tuple(t.shape) in ((), (1,)):
        t = t.reshape(1).float().expand(kv)
    elif tuple(t.shape) == (kv,):
        t = t.float()
    else:
        raise CheckpointError(f"{directory}: tensor {ck!r} has shape {list(t.shape)}, expected a scale per layer "
                              f"([] or [1]) or per KV head ([{kv}])")
    _check_positive(directory, ck, t)
    return t.contiguous()


def _check_positive(directory, ck: str, t: torch.Tensor) -> None:
    """Scales (FP8 weights' or an FP8 KV cache's) must be positive finite numbers."""
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise CheckpointError(f"{directory}: tensor {ck!r} has {int(bad.sum())} scale(s) that are not positive "
                              f"finite numbers (e.g. {float(t[bad][0])})")


# ---- FP8 ----------------------------------------------------------------------------------
def checkpoint_name(cfg: MuseSpark1xConfig, canonical: str) -> str:
    """A canonical name as the checkpoint spells it (the draft's lack the ``model.`` prefix)."""
    return canonical.removeprefix("model.") if isinstance(cfg, MuseSparkDSparkConfig) else canonical


def checkpoint_parts(cfg: MuseSpark1xConfig, module: str) -> list[str]:
    """The checkpoint's module names (unstacked: ``q_proj`` …, the draft's without ``model.``) of the canonical
    projection ``module`` (``model.layers.N.self_attn.qkv_proj`` …)."""
    prefix, _, proj = module.rpartition(".")
    parts = {"qkv_proj": _STACKED_QKV if cfg.attn_output_gate else _STACKED_QKV[:3],
             "gate_up_proj": _STACKED_FFN}.get(proj, (proj,))
    return [checkpoint_name(cfg, f"{prefix}.{p}") for p in parts]


def fp8_projections(cfg: MuseSpark1xConfig) -> list[str]:
    """The canonical projections (``model.layers.N.self_attn.qkv_proj`` …) an FP8 checkpoint of ``cfg``
    holds in FP8: every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``
    whose modules ``ignored_layers`` does not name; none without ``quantization_config``. A stacked
    projection is quantized whole: ignoring some of its parts (``q_proj`` but not ``k_proj``) is an error."""
    quant = cfg.quantization_config
    if quant is None:
        return []
    out = []
    for i in range(cfg.num_hidden_layers):
        for proj in QUANTIZABLE_STACKED:
            module = f"model.layers.{i}.{proj}"
            parts = checkpoint_parts(cfg, module)
            ignored = [quant.ignores(p, "model." + p.removeprefix("model."), module) for p in parts]
            if all(ignored):
                continue
            if any(ignored):
                kept = [p for p, ig in zip(parts, ignored) if not ig]
                raise CheckpointError(
                    f"quantization_config: ignored_layers names {[p for p, ig in zip(parts, ignored) if ig]} but not "
                    f"{kept}; they are stacked into one projection ({module}), quantized whole or not at all")
            out.append(module)
    return out


def _fp8_role(cfg: MuseSpark1xConfig, ck_module: str) -> str:
    """Why the module ``ck_module`` (checkpoint spelling) holds no FP8 tensors, in words."""
    quant = cfg.quantization_config
    if quant is None:
        return "the checkpoint's config.json has no quantization_config (FP8 checkpoints declare quant_method 'fp8')"
    canonical = ck_module if ck_module.startswith("model.") or ck_module == "lm_head" else "model." + ck_module
    if quantizable(ck_module) or quantizable(canonical):
        return f"{ck_module} is in quantization_config's ignored_layers"
    return ("only the decoder layers' projections (q/k/v/o_gate/o, gate/up/down) are FP8; embeddings, lm_heads, "
            "norms, residual gates, the draft's fc, Markov and confidence heads stay in torch_dtype")


# ---- name mapping (vLLM's WeightsMapper) -------------------------------------------
_STACKED_QKV = ("q_proj", "k_proj", "v_proj", "o_gate_proj")
_STACKED_FFN = ("gate_proj", "up_proj")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _draft_rename(source: TensorSource) -> dict[str, str]:
    """Checkpoint name → canonical name for the draft (before stacking)."""
    out: dict[str, str] = {}
    has_lm_head = has_d2t = False
    for name in source.names():
        if name == "t2d":
            continue
        if name == "d2t":
            out[name] = "draft_id_to_target_id"
            has_d2t = True
            continue
        new = name if "lm_head" in name else "model." + name
        if "lm_head" in name:
            has_lm_head = True
        if new.startswith(("model.embed_tokens", "model.mask_embedding")):
            continue
        out[name] = new
    if not has_lm_head:
        raise CheckpointError("Muse Spark DSpark requires its own lm_head")
    if not has_d2t:
        raise CheckpointError("Muse Spark DSpark requires a d2t vocabulary mapping")
    return out


# vLLM's stacked mapping: per-layer suffix → (stacked suffix, part); FP8 scales follow their weights.
_KINDS = ("weight", "weight_scale", "input_scale")
_STACKED = {
    **{f"self_attn.{p}.{k}": (f"self_attn.qkv_proj.{k}", p) for p in _STACKED_QKV for k in _KINDS},
    **{f"feed_forward.{p}.{k}": (f"feed_forward.gate_up_proj.{k}", p) for p in _STACKED_FFN for k in _KINDS},
}


def _iter_canonical(source: TensorSource, cfg: MuseSpark1xConfig) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """Yield (canonical name, [(part, checkpoint name) …]) groups to load."""
    rename = _draft_rename(source) if isinstance(cfg, MuseSparkDSparkConfig) else {n: n for n in source.names()}
    groups: dict[str, list[tuple[str, str]]] = {}
    for ck_name, new in rename.items():
        key, part = new, ""
        m = _LAYER_RE.match(new)
        if m and m.group(2) in _STACKED:
            stacked, part = _STACKED[m.group(2)]
            key = f"model.layers.{m.group(1)}.{stacked}"
        groups.setdefault(key, []).append((part, ck_name))
    yield from groups.items()


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                                  "float8_e8m0fnu") if hasattr(torch, n))


def check_dtype(directory, ck_name: str, name: str, t: torch.Tensor, cfg: MuseSpark1xConfig, fp8: bool = False) -> None:
    """A checkpoint tensor's dtype against the checkpoint's: ``d2t`` integer; an FP8 projection's weight
    (``fp8``) float8_e4m3fn; every other tensor the config's ``torch_dtype``, except that vectors (norm
    weights, residual gates, biases) may be float32."""
    if fp8:
        if t.dtype != FP8:
            raise CheckpointError(
                f"{directory}: tensor {ck_name!r} has dtype {dtype_name(t.dtype)}, expected float8_e4m3fn: the "
                f"config's quantization_config (quant_method 'fp8') quantizes the decoder layers' projections (list "
                f"the module in ignored_layers to keep it in {cfg.torch_dtype})")
        return
    if t.dtype in _FP8_DTYPES:
        module = ck_name.rpartition(".")[0]
        if t.dtype != FP8:
            why = "FP8 weights are E4M3 (float8_e4m3fn)"
        else:
            why = _fp8_role(cfg, module)
        raise CheckpointError(f"{directory}: tensor {ck_name!r} has dtype {dtype_name(t.dtype)}, expected "
                              f"{dtype_name(cfg.dtype)}: {why}")
    if name == "draft_id_to_target_id":
        if not _is_integer(t):
            raise CheckpointError(f"{directory}: tensor {ck_name!r} has dtype {dtype_name(t.dtype)}, expected an "
                                  "integer dtype (int64 or int32: d2t holds vocabulary offsets)")
        return
    want = cfg.dtype
    if t.dtype == want or (t.dim() <= 1 and t.dtype == torch.float32):
        return
    also = " (or float32 for a vector)" if t.dim() <= 1 and want != torch.float32 else ""
    raise CheckpointError(
        f"{directory}: tensor {ck_name!r} has dtype {dtype_name(t.dtype)}, expected {dtype_name(want)}{also}, the "
        f"checkpoint's torch_dtype; mixed or quantized weights are not converted silently (convert the checkpoint "
        f"or correct its config's torch_dtype)"
    )


def _check_finite(name: str, t: torch.Tensor) -> None:
    if t.dtype == FP8:  # (E4M3 has no infinities; NaN is S.1111.111)
        n_nan = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
        if n_nan:
            raise CheckpointError(f"tensor {name!r} has non-finite values ({n_nan} NaN)")
        return
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        raise CheckpointError(f"tensor {name!r} has non-finite values ({n_nan} NaN, {n_inf} Inf)")


def load_state_dict(directory: str | Path, cfg: MuseSpark1xConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read, map, stack, validate and convert a checkpoint → canonical state dict (FP8 projections:
    their float8_e4m3fn weight and float32 [out, 1] ``weight_scale``, not converted)."""
    source = TensorSource(directory)
    fp8 = set(fp8_projections(cfg))
    expect = expected_shapes(cfg)
    is_draft = isinstance(cfg, MuseSparkDSparkConfig)
    order_qkv = _STACKED_QKV if cfg.attn_output_gate else _STACKED_QKV[:3]
    sd: dict[str, torch.Tensor] = {}
    scale_groups: dict[str, list[tuple[str, str]]] = {}
    layouts: dict[str, list[tuple[str, str, int]]] = {}  # FP8 module → [(part, checkpoint module, rows)]
    for name, parts in _iter_canonical(source, cfg):
        if _KV_SCALE_RE.match(name) and not is_draft:
            if cfg.fp8_kv_cache:  # (else ignored: the cache holds the compute dtype)
                sd[name] = _kv_scale(directory, parts[0][1], source.get(parts[0][1]), cfg)
            continue
        if name not in expect:
            raise _unexpected(directory, name, parts, cfg, fp8)
        if name.endswith((".weight_scale", ".input_scale")):
            scale_groups[name] = parts  # (read with their weight's layout, below)
            continue
        module = name.rpartition(".")[0]
        quantized = module in fp8
        if name.endswith("qkv_proj.weight") or name.endswith("gate_up_proj.weight"):
            order = order_qkv if "qkv" in name else _STACKED_FFN
            have = {p: n for p, n in parts}
            extra = set(have) - set(order)
            if extra:
                raise CheckpointError(f"{directory}: unexpected tensor {have[sorted(extra)[0]]!r}")
            prefix = name.rsplit(".", 2)[0]  # model.layers.N.self_attn / .feed_forward
            if is_draft:
                prefix = prefix.removeprefix("model.")  # as the draft checkpoint names it
            missing = [f"{prefix}.{part}.weight" for part in order if part not in have]
            if missing:
                raise CheckpointError(f"{directory}: missing tensor {missing[0]!r}")
            pieces = [(have[part], source.get(have[part])) for part in order]
            for ck, piece in pieces:  # (before the stacking, which would promote a mixed set)
                check_dtype(directory, ck, name, piece, cfg, quantized)
            tensor = _stack_checked(directory, pieces, order, cfg)
            layouts[module] = [(part, ck.removesuffix(".weight"), int(piece.shape[0]))
                               for part, (ck, piece) in zip(order, pieces)]
        else:
            tensor = source.get(parts[0][1])
            check_dtype(directory, parts[0][1], name, tensor, cfg, quantized)
            if quantized:
                layouts[module] = [("", parts[0][1].removesuffix(".weight"), expect[name][0])]
        shape = expect[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{directory}: tensor {parts[0][1]!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        _check_finite(parts[0][1], tensor)
        if quantized:
            pass  # FP8 stays FP8 (the scales are read below)
        elif name == "draft_id_to_target_id":
            tensor = tensor.to(torch.int64)
        elif name.endswith("residual_gate"):
            tensor = tensor.to(torch.float32)
        else:
            tensor = tensor.to(dtype)
        sd[name] = tensor
    static = cfg.quantization_config is not None and cfg.quantization_config.static
    for module in sorted(fp8 & set(layouts)):
        sd[f"{module}.weight_scale"] = _load_scales(directory, source, module, "weight_scale", layouts[module],
                                                    scale_groups.pop(f"{module}.weight_scale", []))
        if static:
            sd[f"{module}.input_scale"] = _load_scales(directory, source, module, "input_scale", layouts[module],
                                                       scale_groups.pop(f"{module}.input_scale", []))
    declared = cfg.quantization_config is not None and cfg.quantization_config.kv_cache_scheme is not None
    for name, shape in expect.items():
        if name.endswith("residual_gate") and name not in sd:
            sd[name] = torch.ones(shape, dtype=torch.float32)  # absent gates mean 1
        elif _KV_SCALE_RE.match(name) and name not in sd:
            if declared:
                raise CheckpointError(f"{directory}: missing tensor {name!r} (the FP8 KV cache's scale that "
                                      "quantization_config's kv_cache_scheme declares)")
            sd[name] = torch.ones(shape, dtype=torch.float32)  # an FP8 cache asked for without scales: 1
        elif name not in sd:
            shown = {"draft_id_to_target_id": "d2t"}.get(name, name)
            if is_draft and shown.startswith("model."):
                shown = shown[len("model."):]
            raise CheckpointError(f"{directory}: missing tensor {shown!r} of shape {list(shape)}")
    if is_draft:
        check_d2t(sd["draft_id_to_target_id"], cfg)
    source.close()
    return sd


_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # (widened to float32 exactly)


def _load_scales(directory, source: TensorSource, module: str, kind: str, layout: list[tuple[str, str, int]],
                 parts: list[tuple[str, str]]) -> torch.Tensor:
    """An FP8 projection's ``weight_scale`` (→ float32 [out, 1]: a per-tensor scale expanded over its
    rows, parts stacked as their weights) or ``input_scale`` (→ float32 []: the parts' largest)."""
    have = dict(parts)
    wanted = {part for part, _, _ in layout}
    extra = sorted(set(have) - wanted)
    if extra:
        raise CheckpointError(f"{directory}: unexpected tensor {have[extra[0]]!r} (the weights of {module} are "
                              f"stored as {[ck + '.weight' for _, ck, _ in layout]})")
    pieces = []
    for part, ck_module, rows in layout:
        ck = f"{ck_module}.{kind}"
        if part not in have:
            what = ("its FP8 weight's scale" if kind == "weight_scale"
                    else "the static activation scale quantization_config's activation_scheme 'static' asks for")
            raise CheckpointError(f"{directory}: missing tensor {ck!r} ({what})")
        t = source.get(have[part])
        ck = have[part]
        if t.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"{directory}: tensor {ck!r} has dtype {dtype_name(t.dtype)}, expected float32 "
                                  "(FP8 scales are float32; bfloat16 and float16 are widened exactly)")
        shape = tuple(t.shape)
        if shape in ((), (1,)):
            t = t.reshape(1, 1).float().expand(rows, 1) if kind == "weight_scale" else t.reshape(()).float()
        elif kind == "weight_scale" and shape in ((rows,), (rows, 1)):
            t = t.reshape(rows, 1).float()
        else:
            want = ("a per-tensor scale ([] or [1]) or a per-output-channel scale "
                    f"([{rows}, 1] or [{rows}]); block-wise scales are not supported") if kind == "weight_scale" \
                else "a per-tensor scale ([] or [1])"
            raise CheckpointError(f"{directory}: tensor {ck!r} has shape {list(shape)}, expected {want}")
        _check_positive(directory, ck, t)
        pieces.append(t)
    if kind == "input_scale":
        return torch.stack(pieces).max().contiguous()
    return torch.cat(pieces, 0).contiguous()


def _unexpected(directory, name: str, parts: list[tuple[str, str]], cfg: MuseSpark1xConfig,
                fp8: set[str]) -> CheckpointError:
    """The error for a tensor the model has no place for, saying why for FP8 scales."""
    shown = parts[0][1]
    module, _, kind = name.rpartition(".")
    if kind == "weight_scale_inv":
        return CheckpointError(f"{directory}: tensor {shown!r}: block-wise FP8 scales (weight_scale_inv) are not "
                               "supported; FP8 scales must be per tensor or per output channel (docs/fp8.md)")
    if kind in ("weight_scale", "input_scale"):
        quant = cfg.quantization_config
        ck_module = shown.rpartition(".")[0]
        if module in fp8 and kind == "input_scale":
            return CheckpointError(
                f"{directory}: tensor {shown!r} is a static activation scale, but quantization_config's "
                "activation_scheme is 'dynamic' (activations are scaled per call): set it to 'static' or drop the "
                "input_scale tensors")
        if quant is None or module not in fp8:
            return CheckpointError(f"{directory}: unexpected tensor {shown!r}: {_fp8_role(cfg, ck_module)}")
    return CheckpointError(f"{directory}: unexpected tensor {shown!r} (not part of this {cfg.KIND} model)")


def _stack_checked(directory, pieces, order, cfg) -> torch.Tensor:
    """Concatenate [(checkpoint name, tensor)] in ``order`` after checking each shape."""
    d = cfg.hidden_size
    sizes = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size, "o_gate_proj": cfg.q_size,
             "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    for part, (ck, p) in zip(order, pieces):
        want = (sizes[part], d)
        if tuple(p.shape) != want:
            if isinstance(cfg, MuseSparkDSparkConfig) and part in ("k_proj", "v_proj"):
                raise CheckpointError(
                    f"Muse Spark DSpark layers must share KV geometry: {ck} has shape {list(p.shape)}, "
                    f"expected {list(want)} ({cfg.num_key_value_heads} KV heads of dim {cfg.head_dim})"
                )
            raise CheckpointError(f"{directory}: tensor {ck!r} has shape {list(p.shape)}, expected {list(want)}")
    return torch.cat([p for _, p in pieces], 0)


def check_d2t(d2t: torch.Tensor, cfg: MuseSparkDSparkConfig) -> None:
    """d2t holds offsets: target = draft + d2t[draft]; every target id in range, no two equal."""
    target = torch.arange(cfg.draft_vocab_size, dtype=torch.int64) + d2t.to(torch.int64).cpu()
    bad = ((target < 0) | (target >= cfg.vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(
            f"d2t maps draft id {i} to target id {int(target[i])}, outside the target vocabulary "
            f"[0, {cfg.vocab_size}) ({bad.numel()} such ids)"
        )
    if torch.unique(target).numel() != target.numel():
        raise CheckpointError("d2t maps two draft ids to the same target id")


# ---- building modules ---------------------------------------------------------------------
def materialize(module: torch.nn.Module, sd: dict[str, torch.Tensor], device, dtype: torch.dtype) -> None:
    """Load the canonical state dict ``sd`` into ``module`` (built on meta) in place (assigned, no second
    copy), with an ``Fp8Linear`` for every projection ``sd`` holds FP8 (its ``weight_scale``), then onto
    ``device`` for inference."""
    for name in sd:  # FP8 projections: an Fp8Linear in place of the nn.Linear (on meta, as the rest)
        if name.endswith(".weight_scale"):
            path = name.removesuffix(".weight_scale")
            with torch.device("meta"):
                Fp8Linear.install(module, path, dtype, static=f"{path}.input_scale" in sd)
    module.load_state_dict(sd, strict=True, assign=True)
    module.after_load()  # materializes the non-persistent constants (still on meta until now)
    module.to(device)
    module.eval().requires_grad_(False)


def with_kv_cache_dtype(cfg: MuseSpark1xConfig, kv_cache_dtype: str | None) -> MuseSpark1xConfig:
    """``cfg`` with its KV cache ``kv_cache_dtype`` ("auto" | "fp8"; None: the checkpoint's own)."""
    if kv_cache_dtype is None or kv_cache_dtype == cfg.kv_cache_dtype:
        return cfg
    cfg = dataclasses.replace(cfg, kv_cache_dtype=kv_cache_dtype)
    cfg.validate(f"--kv-cache-dtype {kv_cache_dtype}")
    return cfg


def load_target(directory: str | Path, dtype: torch.dtype | str | None = None, device="cpu",
                aux_layer_ids: tuple[int, ...] = (), kv_cache_dtype: str | None = None) -> MuseSpark1xForCausalLM:
    """The target checkpoint in ``directory`` (``kv_cache_dtype``: its KV cache's, over the config's)."""
    cfg = load_config(directory)
    if isinstance(cfg, MuseSparkDSparkConfig):
        raise CheckpointError(f"{directory}: this is a DSpark draft checkpoint, expected a target")
    cfg = with_kv_cache_dtype(cfg, kv_cache_dtype)
    dt = parse_dtype(dtype) if dtype is not None else cfg.dtype
    sd = load_state_dict(directory, cfg, dt)
    with torch.device("meta"):
        model = MuseSpark1xForCausalLM(cfg, aux_layer_ids)
    materialize(model, sd, device, dt)
    return model


def load_draft(directory: str | Path, target_cfg: MuseSpark1xConfig | None = None,
               dtype: torch.dtype | str | None = None, device="cpu") -> MuseSparkDSparkForCausalLM:
    cfg = load_config(directory)
    if not isinstance(cfg, MuseSparkDSparkConfig):
        raise CheckpointError(f"{directory}: not a DSpark draft checkpoint (config has no draft_vocab_size)")
    if target_cfg is not None:
        cfg.validate_against(target_cfg, f"{Path(directory) / 'config.json'}")
    dt = parse_dtype(dtype) if dtype is not None else cfg.dtype
    sd = load_state_dict(directory, cfg, dt)
    with torch.device("meta"):
        model = MuseSparkDSparkForCausalLM(cfg)
    materialize(model, sd, device, dt)
    return model


def load_pair(target_dir, draft_dir, dtype=None, device="cpu", kv_cache_dtype: str | None = None):
    """Load target + draft, cross-validate, share the target's embeddings with the draft (``kv_cache_dtype``:
    the target's KV cache, "auto" or "fp8"; None: as its checkpoint says)."""
    target_cfg = load_config(target_dir)
    draft = load_draft(draft_dir, target_cfg, dtype, device)
    target = load_target(target_dir, dtype, device, aux_layer_ids=draft.cfg.target_layer_ids,
                         kv_cache_dtype=kv_cache_dtype)
    draft.bind_target_embeddings(target.model.embed_tokens.weight)
    return target, draft


# ---- saving / hashing ---------------------------------------------------------------------
def save_canonical(module: torch.nn.Module, path: str | Path) -> None:
    """Save a module's canonical state dict (contiguous) as one safetensors file (FP8 projections as their
    float8_e4m3fn weight, float32 ``weight_scale`` and, static, ``input_scale``: docs/fp8.md)."""
    sd = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(sd, str(path))


def tensors_hash(directory: str | Path) -> str:
    """sha256 over the sorted (name, dtype, shape, bytes) of a checkpoint's tensors."""
    source = TensorSource(directory)
    h = hashlib.sha256()
    for name in sorted(source.names()):
        t = source.get(name).contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        # (flattened first: a 0-d tensor, such as a static input_scale, has no byte view of its own)
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    source.close()
    return h.hexdigest()


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
