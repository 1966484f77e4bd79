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
* a file or folder that cannot be read (permission denied, a folder where a file
  should be, …) is a ``CheckpointError`` naming the path and the reason;
* memory: safetensors maps the files; tensors are converted one at a time and
  assigned into modules built on the meta device (``load_state_dict(assign=True)``),
  so the process never holds two full copies of the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from muse_spark.config import (MuseSpark1xConfig, MuseSparkDSparkConfig, dtype_name, load_config, missing_note,
                               os_error_reason, parse_dtype)
from muse_spark.models.draft import MuseSparkDSparkForCausalLM
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
    return s


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


# vLLM's stacked mapping: per-layer suffix → (stacked suffix, part).
_STACKED = {
    **{f"self_attn.{p}.weight": ("self_attn.qkv_proj.weight", p) for p in _STACKED_QKV},
    **{f"feed_forward.{p}.weight": ("feed_forward.gate_up_proj.weight", p) for p in _STACKED_FFN},
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


def check_dtype(directory, ck_name: str, name: str, t: torch.Tensor, cfg: MuseSpark1xConfig) -> None:
    """A checkpoint tensor's dtype against the checkpoint's: ``d2t`` integer; every other tensor the
    config's ``torch_dtype``, except that vectors (norm weights, residual gates, biases) may be float32."""
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
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        raise CheckpointError(f"tensor {name!r} has non-finite values ({n_nan} NaN, {n_inf} Inf)")


def load_state_dict(directory: str | Path, cfg: MuseSpark1xConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read, map, stack, validate and convert a checkpoint → canonical state dict."""
    source = TensorSource(directory)
    expect = expected_shapes(cfg)
    is_draft = isinstance(cfg, MuseSparkDSparkConfig)
    order_qkv = _STACKED_QKV if cfg.attn_output_gate else _STACKED_QKV[:3]
    sd: dict[str, torch.Tensor] = {}
    for name, parts in _iter_canonical(source, cfg):
        if name not in expect:
            shown = parts[0][1]
            raise CheckpointError(f"{directory}: unexpected tensor {shown!r} (not part of this {cfg.KIND} model)")
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
                check_dtype(directory, ck, name, piece, cfg)
            tensor = _stack_checked(directory, pieces, order, cfg)
        else:
            tensor = source.get(parts[0][1])
            check_dtype(directory, parts[0][1], name, tensor, cfg)
        shape = expect[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{directory}: tensor {parts[0][1]!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        _check_finite(parts[0][1], tensor)
        if name == "draft_id_to_target_id":
            tensor = tensor.to(torch.int64)
        elif name.endswith("residual_gate"):
            tensor = tensor.to(torch.float32)
        else:
            tensor = tensor.to(dtype)
        sd[name] = tensor
    for name, shape in expect.items():
        if name.endswith("residual_gate") and name not in sd:
            sd[name] = torch.ones(shape, dtype=torch.float32)  # absent gates mean 1
        elif name not in sd:
            shown = {"draft_id_to_target_id": "d2t"}.get(name, name)
            if is_draft and shown.startswith("model."):
                shown = shown[len("model."):]
            raise CheckpointError(f"{directory}: missing tensor {shown!r} of shape {list(shape)}")
    if is_draft:
        check_d2t(sd["draft_id_to_target_id"], cfg)
    source.close()
    return sd


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
def _materialize(module: torch.nn.Module, sd: dict[str, torch.Tensor], device) -> None:
    module.load_state_dict(sd, strict=True, assign=True)
    module.after_load()  # materializes the non-persistent constants (still on meta until now)
    module.to(device)
    module.eval().requires_grad_(False)


def load_target(directory: str | Path, dtype: torch.dtype | str | None = None, device="cpu",
                aux_layer_ids: tuple[int, ...] = ()) -> MuseSpark1xForCausalLM:
    cfg = load_config(directory)
    if isinstance(cfg, MuseSparkDSparkConfig):
        raise CheckpointError(f"{directory}: this is a DSpark draft checkpoint, expected a target")
    dt = parse_dtype(dtype) if dtype is not None else cfg.dtype
    sd = load_state_dict(directory, cfg, dt)
    with torch.device("meta"):
        model = MuseSpark1xForCausalLM(cfg, aux_layer_ids)
    _materialize(model, sd, device)
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
    _materialize(model, sd, device)
    return model


def load_pair(target_dir, draft_dir, dtype=None, device="cpu"):
    """Load target + draft, cross-validate, share the target's embeddings with the draft."""
    target_cfg = load_config(target_dir)
    draft = load_draft(draft_dir, target_cfg, dtype, device)
    target = load_target(target_dir, dtype, device, aux_layer_ids=draft.cfg.target_layer_ids)
    draft.bind_target_embeddings(target.model.embed_tokens.weight)
    return target, draft


# ---- saving / hashing ---------------------------------------------------------------------
def save_canonical(module: torch.nn.Module, path: str | Path) -> None:
    """Save a module's canonical state dict (contiguous) as one safetensors file."""
    sd = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(sd, str(path))


def tensors_hash(directory: str | Path) -> str:
    """sha256 over the sorted (name, dtype, shape, bytes) of a checkpoint's tensors."""
    source = TensorSource(directory)
    h = hashlib.sha256()
    for name in sorted(source.names()):
        t = source.get(name).contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    source.close()
    return h.hexdigest()


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
