"""Frozen, validated configs for the Muse Spark target and the DSpark draft.

Both are parsed from HF-style ``config.json`` files (docs/design.md). Every
inconsistency is a ``ValueError`` naming the field and the values, so a bad
checkpoint fails at load time and never half-way through a build.

FP8 checkpoints (docs/fp8.md) carry ``quantization_config``
(``QuantizationConfig``): ``quant_method`` ``"fp8"`` (E4M3 weights with per-tensor or
per-output-channel scales; block-wise scales and other methods are refused by name). What is
quantized is fixed: the decoder layers' projections of the target and the draft (``q/k/v/o_gate/o``,
``gate/up/down``) unless ``ignored_layers``/``modules_to_not_convert`` names them. The embeddings,
the lm_heads, the norms, the residual gates, the draft's ``fc``, its Markov head and its
confidence head always stay in ``torch_dtype``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
QUANT_METHODS = ("fp8",)
ACTIVATION_SCHEMES = ("dynamic", "static")
# The target's KV cache: "auto" (the compute dtype) or "fp8" (E4M3 codes with a float32 scale per layer and KV
# head, ``models.layers.Attention.k_scale``/``v_scale``; docs/fp8.md)
KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_scheme(kv: Any, where: str) -> None:
    """A ``quantization_config.kv_cache_scheme`` as llm-compressor writes it for an FP8 KV cache with static
    scales: ``{"num_bits": 8, "type": "float", "strategy": "tensor" | "attn_head", "dynamic": false,
    "symmetric": true}`` (the scales are the layers' ``self_attn.k_scale``/``v_scale``). Anything else is
    refused by what it asks for."""
    w = f"{where}: quantization_config.kv_cache_scheme"
    if not isinstance(kv, dict):
        raise ValueError(f"{w} must be an object, got {kv!r}")
    if kv.get("num_bits", 8) != 8 or kv.get("type", "float") != "float":
        raise ValueError(f"{w} {kv!r}: only an 8-bit float (E4M3) KV cache is supported")
    if kv.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise ValueError(f"{w}: strategy {kv.get('strategy')!r} is not supported (a scale per layer, 'tensor', "
                         "or per layer and KV head, 'attn_head')")
    if kv.get("dynamic", False) is not False:
        raise ValueError(f"{w}: dynamic KV-cache scales are not supported (static k_scale/v_scale tensors are)")
    if kv.get("symmetric", True) is not True:
        raise ValueError(f"{w}: asymmetric KV-cache quantization is not supported")


def parse_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{what}: unknown dtype {name!r} (expected one of {sorted(set(_DTYPES))})")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_OS_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied (operation not permitted)",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory, expected a file",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
}


def os_error_reason(e: OSError) -> str:
    """A failed file-system call's reason in words (``permission denied``, …), for messages
    that name the path themselves."""
    return _OS_REASONS.get(e.errno, e.strerror or str(e))


def missing_note(path: str | Path) -> str:
    """For a folder path that is not there: `` (… is a file, not a directory)`` when it or one of its
    parents exists but is not a folder, else ``""``."""
    for parent in (Path(path), *Path(path).parents):
        try:
            if parent.exists():
                return "" if parent.is_dir() else f" ({parent} is a file, not a directory)"
        except OSError:
            return ""
    return ""


@dataclass(frozen=True)
class MetapConfig:
    use_metap: bool = False
    router_has_one_inf_dim: bool = False
    base_width: int = 1
    metap_mode: str = "mup"


@dataclass(frozen=True)
class QuantizationConfig:
    """``config.json``'s ``quantization_config`` for FP8 (E4M3) weights (docs/fp8.md).

    * ``quant_method``: ``"fp8"`` (the only method read; others — ``compressed-tensors``,
      ``fbgemm_fp8``, ``modelopt``, int4/int8 methods — are refused by name);
    * ``activation_scheme``: ``"dynamic"`` (no ``input_scale`` tensors; the reference path is
      weight-only, W8A16) or ``"static"`` (every quantized projection carries a scalar
      ``input_scale``, kept for a W8A8 kernel);
    * ``ignored_layers`` (vLLM's name) and ``modules_to_not_convert`` (transformers'): module
      names kept in ``torch_dtype``; an entry matches a module equal to it, ending in ``.entry``
      or inside it (``entry.…``), or, written ``re:PATTERN``, one the pattern matches whole;
    * ``weight_block_size``: must be null — block-wise scales are refused;
    * ``kv_cache_scheme``: null, or an FP8 KV cache with static scales (``check_kv_cache_scheme``): the
      target's config then has ``kv_cache_dtype`` ``"fp8"`` and its layers' ``k_scale``/``v_scale`` are read.

    Scales are per tensor or per output channel; what is quantized is fixed (the decoder layers'
    projections; ``quantizable``)."""

    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()
    # an FP8 KV cache with the checkpoint's static scales (``check_kv_cache_scheme``); None: no KV-cache scheme
    kv_cache_scheme: dict | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_dict(cls, d: Any, where: str = "config.json") -> "QuantizationConfig":
        w = f"{where}: quantization_config"
        if not isinstance(d, dict):
            raise ValueError(f"{w} must be an object, got {d!r}")
        method = d.get("quant_method")
        if not isinstance(method, str):
            raise ValueError(f"{w}: missing or non-string 'quant_method' (expected one of {list(QUANT_METHODS)})")
        if method not in QUANT_METHODS:
            raise ValueError(f"{w}: unsupported quant_method {method!r}; this loader reads FP8 (E4M3) checkpoints "
                             f"with quant_method 'fp8' and per-tensor or per-channel scales (docs/fp8.md) — "
                             "requantize the bf16 checkpoint with `muse-spark quantize`")
        block = d.get("weight_block_size")
        if block is not None:
            raise ValueError(f"{w}: block-wise FP8 (weight_block_size {block!r}) is not supported: the weights' "
                             "scales must be per tensor or per output channel (weight_block_size null) — "
                             "requantize the bf16 checkpoint with `muse-spark quantize`")
        fmt = d.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{w}: fmt {fmt!r} is not supported (FP8 weights are E4M3, float8_e4m3fn)")
        kv = d.get("kv_cache_scheme")
        if kv is not None:
            check_kv_cache_scheme(kv, where)
        scheme = d.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"{w}: activation_scheme must be one of {list(ACTIVATION_SCHEMES)}, got {scheme!r}")
        ignored: list[str] = []
        for key in ("ignored_layers", "modules_to_not_convert"):
            names = d.get(key)
            if names is None:
                continue
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise ValueError(f"{w}: {key} must be a list of module names, got {names!r}")
            for n in names:
                if n.startswith("re:"):
                    try:
                        re.compile(n[3:])
                    except re.error as e:
                        raise ValueError(f"{w}: {key} entry {n!r} is not a valid regular expression ({e})") from None
                if n not in ignored:
                    ignored.append(n)
        return cls(method, scheme, tuple(ignored), dict(kv) if kv is not None else None)

    def to_dict(self) -> dict[str, Any]:
        d = {"quant_method": self.quant_method, "activation_scheme": self.activation_scheme,
             "ignored_layers": list(self.ignored_layers), "weight_block_size": None}
        if self.kv_cache_scheme is not None:
            d["kv_cache_scheme"] = dict(self.kv_cache_scheme)
        return d

    @property
    def static(self) -> bool:
        return self.activation_scheme == "static"

    def ignores(self, *module_names: str) -> bool:
        """Whether an entry of ``ignored_layers`` names the module (any of its spellings: the
        checkpoint's and the canonical name)."""
        for entry in self.ignored_layers:
            for name in module_names:
                if entry.startswith("re:"):
                    if re.fullmatch(entry[3:], name):
                        return True
                elif name == entry or name.endswith("." + entry) or name.startswith(entry + "."):
                    return True
        return False


# The decoder-layer projections FP8 may quantize (the suffix after ``layers.N.``), as the checkpoints
# name them (vLLM's unstacked names) and stacked as the modules hold them.
QUANTIZABLE_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_gate_proj",
                     "self_attn.o_proj", "feed_forward.gate_proj", "feed_forward.up_proj",
                     "feed_forward.down_proj")
QUANTIZABLE_STACKED = ("self_attn.qkv_proj", "self_attn.o_proj", "feed_forward.gate_up_proj",
                       "feed_forward.down_proj")
_QUANTIZABLE_RE = re.compile(r"^(?:model\.)?layers\.\d+\.(?:%s)$" % "|".join(
    re.escape(p) for p in sorted(set(QUANTIZABLE_PARTS + QUANTIZABLE_STACKED))))


def quantizable(module_name: str) -> bool:
    """Whether a module (``model.layers.3.self_attn.q_proj``, a draft's ``layers.0.feed_forward.down_proj``,
    or the stacked ``….qkv_proj``/``….gate_up_proj``) is one FP8 may quantize: a decoder layer's projection.
    Embeddings, lm_heads, norms, residual gates, the draft's fc, Markov and confidence heads are not."""
    return bool(_QUANTIZABLE_RE.match(module_name))


def _req(d: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}: missing required field {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{where}: field {key!r} must be {kind}, got {value!r}")
    if not isinstance(value, kinds):
        raise ValueError(f"{where}: field {key!r} must be {kind}, got {value!r}")
    return value


def _opt(d: dict, key: str, kind: type | tuple, default: Any, where: str) -> Any:
    if key not in d or d[key] is None and default is None:
        return default
    return _req(d, key, kind, where)


@dataclass(frozen=True)
class MuseSpark1xConfig:
    """The dense Muse Spark target (``MuseSpark1xForCausalLM``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    norm_affine: bool = True
    norm_zero_centered_gamma: bool = False
    use_rope: bool = True
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attn_output_gate: bool = False
    residual_dtype: str = "float32"
    torch_dtype: str = "bfloat16"
    residual_multiplier: float = 1.0
    metap: MetapConfig = field(default_factory=MetapConfig)
    output_soft_cap_temp: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    architectures: tuple[str, ...] = ("MuseSpark1xForCausalLM",)
    # FP8 checkpoints: the parsed ``quantization_config`` (None: every weight in torch_dtype)
    quantization_config: QuantizationConfig | None = None
    # The target's KV cache (``KV_CACHE_DTYPES``): "auto" keeps it in torch_dtype; "fp8" holds E4M3 codes with
    # the layers' float32 scales (from the checkpoint's kv_cache_scheme, or ``--kv-cache-dtype fp8``: 1 where
    # the checkpoint has none). The draft's context K/V always stay in torch_dtype.
    kv_cache_dtype: str = "auto"

    KIND = "target"

    # ---- parsing -----------------------------------------------------------------
    @classmethod
    def _fields_from_dict(cls, d: dict, where: str) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: config must be a JSON object, got {type(d).__name__}")
        out: dict[str, Any] = {}
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            out[key] = _req(d, key, int, where)
        out["num_key_value_heads"] = _opt(d, "num_key_value_heads", int, out["num_attention_heads"], where)
        default_hd = out["hidden_size"] // max(out["num_attention_heads"], 1)
        out["head_dim"] = _opt(d, "head_dim", int, default_hd, where)
        out["rms_norm_eps"] = float(_opt(d, "rms_norm_eps", (int, float), 1e-6, where))
        for key, default in (
            ("norm_affine", True),
            ("norm_zero_centered_gamma", False),
            ("use_rope", True),
            ("attn_output_gate", False),
            ("tie_word_embeddings", False),
        ):
            out[key] = _opt(d, key, bool, default, where)
        out["rope_theta"] = float(_opt(d, "rope_theta", (int, float), 10000.0, where))
        out["max_position_embeddings"] = _opt(d, "max_position_embeddings", int, 4096, where)
        out["residual_dtype"] = _opt(d, "residual_dtype", str, "float32", where)
        out["torch_dtype"] = _opt(d, "torch_dtype", str, "bfloat16", where)
        out["residual_multiplier"] = float(_opt(d, "residual_multiplier", (int, float), 1.0, where))
        metap = d.get("metap") or {}
        if not isinstance(metap, dict):
            raise ValueError(f"{where}: field 'metap' must be an object, got {metap!r}")
        out["metap"] = MetapConfig(
            use_metap=bool(metap.get("use_metap", False)),
            router_has_one_inf_dim=bool(metap.get("router_has_one_inf_dim", False)),
            base_width=int(metap.get("base_width", 1)),
            metap_mode=str(metap.get("metap_mode", "mup")),
        )
        cap = d.get("output_soft_cap_temp")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise ValueError(f"{where}: field 'output_soft_cap_temp' must be a number or null, got {cap!r}")
        out["output_soft_cap_temp"] = None if cap is None else float(cap)
        for key in ("bos_token_id", "pad_token_id"):
            out[key] = _opt(d, key, int, None, where)
        eos = d.get("eos_token_id")
        if eos is None:
            out["eos_token_id"] = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            out["eos_token_id"] = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            out["eos_token_id"] = tuple(eos)
        else:
            raise ValueError(f"{where}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
        arch = d.get("architectures")
        if arch is not None:
            out["architectures"] = tuple(arch)
        quant = d.get("quantization_config")
        if quant is not None:
            out["quantization_config"] = QuantizationConfig.from_dict(quant, where)
        kv_dtype = _opt(d, "kv_cache_dtype", str, "auto", where)
        if quant is not None and out["quantization_config"].kv_cache_scheme is not None:
            if kv_dtype not in ("auto", "fp8"):
                raise ValueError(f"{where}: kv_cache_dtype {kv_dtype!r} contradicts quantization_config's "
                                 "kv_cache_scheme (an FP8 KV cache)")
            kv_dtype = "fp8"
        out["kv_cache_dtype"] = kv_dtype
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "MuseSpark1xConfig":
        cfg = cls(**cls._fields_from_dict(d, where))
        cfg.validate(where)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "MuseSpark1xConfig":
        d, where = _read_config_json(path)
        return cls.from_dict(d, where=where)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        d["architectures"] = list(self.architectures)
        if self.quantization_config is None:
            del d["quantization_config"]
        else:
            d["quantization_config"] = self.quantization_config.to_dict()
        if self.kv_cache_dtype == "auto":
            del d["kv_cache_dtype"]
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- validation --------------------------------------------------------------
    def validate(self, where: str = "config") -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{where}: {key} must be >= 1, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"{where}: num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.use_rope and self.head_dim % 2 != 0:
            raise ValueError(f"{where}: head_dim={self.head_dim} must be even when use_rope is true")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"{where}: rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.residual_dtype != "float32":
            raise ValueError(f"{where}: residual_dtype must be 'float32', got {self.residual_dtype!r}")
        parse_dtype(self.torch_dtype, f"{where}: torch_dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{where}: kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.output_soft_cap_temp is not None and not self.output_soft_cap_temp > 0:
            raise ValueError(
                f"{where}: output_soft_cap_temp must be positive or null, got {self.output_soft_cap_temp}"
            )
        if self.metap.use_metap and self.metap.router_has_one_inf_dim:
            if self.metap.metap_mode not in ("mup", "sp"):
                raise ValueError(f"Unknown Metap mode {self.metap.metap_mode!r}")
            if self.metap.base_width < 1:
                raise ValueError(f"{where}: metap.base_width must be >= 1, got {self.metap.base_width}")
        for key in ("bos_token_id", "pad_token_id"):
            v = getattr(self, key)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"{where}: {key}={v} is outside the vocabulary [0, {self.vocab_size})")
        for e in self.eos_token_id:
            if not 0 <= e < self.vocab_size:
                raise ValueError(f"{where}: eos_token_id {e} is outside the vocabulary [0, {self.vocab_size})")

    # ---- derived -----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_out(self) -> int:
        return 2 * self.q_size + 2 * self.kv_size if self.attn_output_gate else self.q_size + 2 * self.kv_size

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def cache_dtype(self, compute: torch.dtype | None = None) -> torch.dtype:
        """The dtype of this model's KV caches: float8_e4m3fn for an FP8 cache, else the compute dtype
        (``compute``, default torch_dtype)."""
        return torch.float8_e4m3fn if self.fp8_kv_cache else (compute or self.dtype)

    def kv_cache_bytes(self, slots: int, max_seq: int, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of the K and V caches the runtime allocates for this model: per layer,
        ``[slots, max_seq, num_key_value_heads, head_dim]`` each, in ``cache_dtype`` of ``dtype`` (the compute
        dtype, default torch_dtype): one byte an element for an FP8 cache."""
        compute = parse_dtype(dtype) if dtype is not None else self.dtype
        itemsize = torch.empty((), dtype=self.cache_dtype(compute)).element_size()
        return 2 * self.num_hidden_layers * slots * max_seq * self.num_key_value_heads * self.head_dim * itemsize

    @property
    def output_multiplier(self) -> float:
        m = self.metap
        if not (m.use_metap and m.router_has_one_inf_dim):
            return 1.0
        width_mult = self.hidden_size / m.base_width
        if m.metap_mode == "mup":
            return width_mult**-1
        if m.metap_mode == "sp":
            return width_mult**-0.5
        raise ValueError(f"Unknown Metap mode {m.metap_mode!r}")


@dataclass(frozen=True)
class MuseSparkDSparkConfig(MuseSpark1xConfig):
    """The DSpark draft (``MuseSparkDSparkForCausalLM``): Muse layers plus the
    block-drafting, Markov and confidence heads."""

    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = 0
    block_size: int = 1
    sample_from_anchor: bool = True
    causal: bool = True
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    dspark_draft_topk: int | None = None
    # Positional mode of the draft layers, when the checkpoint records it apart
    # from ``use_rope`` (vLLM's per-layer rotary_emb); must equal use_rope.
    layer_use_rope: tuple[bool, ...] | None = None
    # Per-layer KV geometry (num_key_value_heads, head_dim), when recorded.
    layer_kv_geometry: tuple[tuple[int, int], ...] | None = None
    architectures: tuple[str, ...] = ("MuseSparkDSparkForCausalLM",)

    KIND = "draft"

    @classmethod
    def _fields_from_dict(cls, d: dict, where: str) -> dict[str, Any]:
        out = super()._fields_from_dict(d, where)
        out["draft_vocab_size"] = _req(d, "draft_vocab_size", int, where)
        out["target_hidden_size"] = _req(d, "target_hidden_size", int, where)
        ids = _req(d, "target_layer_ids", list, where)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{where}: target_layer_ids must be a list of ints, got {ids!r}")
        out["target_layer_ids"] = tuple(ids)
        out["mask_token_id"] = _req(d, "mask_token_id", int, where)
        out["block_size"] = _req(d, "block_size", int, where)
        out["sample_from_anchor"] = _opt(d, "sample_from_anchor", bool, True, where)
        out["causal"] = _opt(d, "causal", bool, True, where)
        out["markov_rank"] = _opt(d, "markov_rank", int, 0, where)
        out["markov_head_type"] = _opt(d, "markov_head_type", str, "vanilla", where)
        out["enable_confidence_head"] = _opt(d, "enable_confidence_head", bool, False, where)
        out["confidence_head_with_markov"] = _opt(d, "confidence_head_with_markov", bool, False, where)
        out["dspark_draft_topk"] = _opt(d, "dspark_draft_topk", int, None, where)
        lur = d.get("layer_use_rope")
        if lur is not None:
            out["layer_use_rope"] = tuple(bool(x) for x in lur)
        geo = d.get("layer_kv_geometry")
        if geo is not None:
            out["layer_kv_geometry"] = tuple((int(a), int(b)) for a, b in geo)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["target_layer_ids"] = list(self.target_layer_ids)
        for key in ("layer_use_rope", "layer_kv_geometry"):
            if d[key] is None:
                del d[key]
        return d

    def validate(self, where: str = "config") -> None:
        super().validate(where)
        if self.fp8_kv_cache:
            raise ValueError(f"{where}: the draft's context K/V stay in torch_dtype (an FP8 KV cache is the "
                             "target's: kv_cache_dtype 'fp8' in the target's config, or --kv-cache-dtype fp8)")
        if self.draft_vocab_size < 1 or self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"{where}: draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        if self.target_hidden_size < 1:
            raise ValueError(f"{where}: target_hidden_size must be >= 1, got {self.target_hidden_size}")
        if not self.target_layer_ids:
            raise ValueError(f"{where}: target_layer_ids must not be empty")
        ids = self.target_layer_ids
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"{where}: target_layer_ids must be strictly increasing, got {list(ids)}")
        if ids[0] < 0:
            raise ValueError(f"{where}: target_layer_ids must be >= 0, got {list(ids)}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"{where}: mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.block_size < 1:
            raise ValueError(f"{where}: block_size must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"{where}: markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"{where}: unknown markov_head_type {self.markov_head_type!r} "
                f"(expected one of {list(MARKOV_HEAD_TYPES)})"
            )
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
        if self.dspark_draft_topk is not None and not 1 <= self.dspark_draft_topk <= self.draft_vocab_size:
            raise ValueError(
                f"{where}: dspark_draft_topk must be in [1, draft_vocab_size={self.draft_vocab_size}], "
                f"got {self.dspark_draft_topk}"
            )
        if not self.sample_from_anchor:
            raise ValueError(f"{where}: sample_from_anchor=false is not supported")
        if self.layer_use_rope is not None:
            if len(self.layer_use_rope) != self.num_hidden_layers or any(
                u != self.use_rope for u in self.layer_use_rope
            ):
                raise ValueError("Muse Spark DSpark layers must share their positional mode")
        if self.layer_kv_geometry is not None:
            if len(set(self.layer_kv_geometry)) > 1 or (
                self.layer_kv_geometry
                and self.layer_kv_geometry[0] != (self.num_key_value_heads, self.head_dim)
            ):
                raise ValueError("Muse Spark DSpark layers must share KV geometry")

    def validate_against(self, target: MuseSpark1xConfig, where: str = "draft config") -> None:
        """Checks that need the target's config too."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{where}: vocab_size={self.vocab_size} differs from the target's vocab_size={target.vocab_size}"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{where}: target_hidden_size={self.target_hidden_size} differs from the target's "
                f"hidden_size={target.hidden_size}"
            )
        last = target.num_hidden_layers - 1
        bad = [i for i in self.target_layer_ids if not 0 <= i < last]
        if bad:
            raise ValueError(
                f"{where}: target_layer_ids {bad} out of range: must be in [0, {last}) "
                f"(the target has {target.num_hidden_layers} layers; its last layer {last} is excluded)"
            )
        if self.hidden_size != target.hidden_size:
            # The draft embeds tokens with the target's embed_tokens.
            raise ValueError(
                f"{where}: hidden_size={self.hidden_size} differs from the target's hidden_size="
                f"{target.hidden_size}; the draft embeds with the target's embed_tokens"
            )
        if self.use_rope and target.use_rope and self.rope_theta != target.rope_theta:
            raise ValueError(
                f"{where}: rope_theta={self.rope_theta} differs from the target's {target.rope_theta}"
            )

    @property
    def gamma(self) -> int:
        return self.block_size


def _read_config_json(path: str | Path) -> tuple[Any, str]:
    """A checkpoint directory or a config.json path → (parsed JSON, its path for messages)."""
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
        if p.is_dir():
            raise ValueError(f"{p}: is a directory, expected the config file")
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}{missing_note(p)}")
        text = p.read_text()
    except OSError as e:  # (FileNotFoundError above is raised as is: it names the file)
        if isinstance(e, FileNotFoundError) and e.errno is None:
            raise
        raise ValueError(f"cannot read {e.filename or p}: {os_error_reason(e)}") from None
    try:
        return json.loads(text), str(p)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON: {e}") from None


def load_config(path: str | Path) -> MuseSpark1xConfig:
    """Parse a target or draft config, choosing the class by its keys."""
    d, where = _read_config_json(path)
    if isinstance(d, dict) and "draft_vocab_size" in d:
        return MuseSparkDSparkConfig.from_dict(d, where)
    return MuseSpark1xConfig.from_dict(d, where)
