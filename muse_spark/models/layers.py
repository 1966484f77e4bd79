"""Muse Spark building blocks in plain PyTorch (docs/design.md, the target model).

These modules are the reference the compiled engines are checked against.
Parameter names are the *canonical* (stacked) ones the loader produces:
``self_attn.qkv_proj`` = [q | k | v | o_gate] and ``feed_forward.gate_up_proj``
= [gate | up].

Attention is written over an explicit key set and a boolean mask so that the
target (KV cache) and the draft (cached context + fresh block) share one
implementation; scores and softmax run in fp32 (``attend_reference``). In bf16/fp16
on CUDA ``attend`` runs a fused kernel instead (``attention_path``), the same one
in the eager engine and in the compiled packages.

Which kernels run is the current kernel options' (``muse_spark.options.current_options()``: the
builder and the engines set them with ``use_options``).

FP8 checkpoints (docs/fp8.md): the loader holds a quantized decoder projection as an ``Fp8Linear``
(float8_e4m3fn ``weight`` + float32 per-channel ``weight_scale``); the layers pass
``proj_weight(module)`` to ``linear``, which for an ``Fp8Weight`` runs the skinny W8A16 kernel where it
fits (``linear_fp8_triton``), W8A8 for more rows in bf16 on FP8 hardware (``fp8_linear_w8a8``: the rows
quantized per token, one ``torch._scaled_mm``), else the W8A16 reference (``fp8_linear_reference``:
dequantized per call, computed in the activations' dtype).
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch import nn
from torch.nn import functional as F

import muse_spark.plugins  # noqa: F401  (registers torch.ops.muse_spark.*)
from muse_spark.plugins import dispatch
from muse_spark.config import MuseSpark1xConfig
from muse_spark.options import KernelOptions, current_options
from muse_spark.plugins.attention.reference import (FP8_MAX, CacheKV, KeyBounds, KVProvider, KVScales,
                                                    Mask, attend_reference, cache_rows, triton_attention_fits)
from muse_spark.plugins.head_norm_rope.reference import head_norm_rope_reference
from muse_spark.plugins.linear.reference import linear_reference, quantize_rows, silu_mul_halves, w8a8_reference
from muse_spark.plugins.norm import rms_norm


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``, as a new tensor (torch's functional collective: eager it
    runs on the group's backend; traced by ``torch.export`` it is a graph op an AOTI package runs on the
    process group of that name at run time)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


def all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of every rank of ``group`` side by side on the last dimension, in rank order (functional, as
    ``all_reduce``)."""
    from torch.distributed import _functional_collectives as funcol

    world = torch.distributed.get_world_size(group)
    stacked = funcol.all_gather_tensor(x.contiguous(), 0, group).view(world, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, affine: bool, zero_centered: bool):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim)) if affine else None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered, out_dtype)


def make_norm(cfg: MuseSpark1xConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_affine, cfg.norm_zero_centered_gamma)


def head_norm_rope(x: torch.Tensor, positions: torch.Tensor, eps: float, theta: float,
                   use_rope: bool) -> torch.Tensor:
    """The attention's q/k normalization: per-head weightless RMS norm, then RoPE (when
    ``use_rope``). x [B, S, heads, Dh] → the same shape in x's dtype. In bf16/fp16 on CUDA (Dh a
    power of two) one Triton kernel for every head of x, in the eager engine and the compiled
    packages alike (compiled, the plain functions became four kernels a layer); otherwise
    ``head_norm_rope_reference``."""
    if x.device.type == "cuda" and _triton_ops_available() and _head_norm_rope_fits(x):
        return torch.ops.muse_spark.head_norm_rope_triton(x, positions, eps, theta, use_rope)
    return head_norm_rope_reference(x, positions, eps, theta, use_rope)


def _head_norm_rope_fits(x: torch.Tensor) -> bool:
    from muse_spark.plugins.head_norm_rope.triton_kernel import fits  # (imports Triton: after _triton_ops_available)

    return fits(x)


def _head_norm_rope_fits_heads(dtype: torch.dtype, head_dim: int) -> bool:
    from muse_spark.plugins.head_norm_rope.triton_kernel import fits_heads  # (imports Triton, as above)

    return fits_heads(dtype, head_dim)


_log = logging.getLogger(__name__)
_warned: set[str] = set()


def nvidia(device) -> bool:
    """Whether ``device`` is an NVIDIA GPU: a CUDA device of a CUDA (not ROCm/HIP) build of torch."""
    return torch.device(device).type == "cuda" and torch.version.hip is None


def attention_path(device, dtype: torch.dtype, options: KernelOptions | None = None) -> str:
    """What ``attend`` runs for this device and compute dtype: the fused kernel of ``options``
    (default: the current ones), ``KernelOptions.attention`` (``triton`` or ``sdpa``), in bf16/fp16
    on NVIDIA GPUs; else ``reference`` (CPU; fp32; ROCm, where the fused Triton path is not used)."""
    fused = nvidia(device) and dtype in (torch.bfloat16, torch.float16)
    return (options or current_options()).attention if fused else "reference"


def _triton_ops_available() -> bool:
    """Whether the Triton plugin ops are registered (registering them); said once when not."""
    try:
        from muse_spark.plugins import triton_ops  # noqa: F401
    except Exception as e:  # no usable Triton: SDPA and cuBLAS
        if "triton" not in _warned:
            _warned.add("triton")
            _log.warning("the Triton kernels are unavailable (%s: %s); attention runs SDPA, linear layers cuBLAS",
                         type(e).__name__, e)
        return False
    return True


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
           slots: torch.Tensor | None = None, scales: KVScales = None) -> torch.Tensor:
    """Masked GQA attention. q [B,S,H,Dh], mask [B,S,T] bool or ``KeyBounds`` (the Triton kernel reads
    its bounds; the other paths expand it) → [B,S,H,Dh] (q's dtype); k/v [B,≥T,KV,Dh],
    or with ``slots`` [B] whole caches [N,≥T,KV,Dh] of which request b reads row ``slots[b]``, or with
    ``slots`` [B, n] pools of blocks [blocks, P, KV, Dh] through the requests' block tables (the Triton
    kernel reads them in place; the other paths gather the rows first).

    bf16/fp16 on CUDA: a fused kernel (``attention_path``; products of the compute dtype, fp32
    accumulation and softmax), which reads K/V once in their own dtype. Otherwise (fp32, CPU):
    ``attend_reference``. Every path ignores keys and values no query may see (stale garbage in
    a reused cache slot, even NaN, can never leak into a request) and gives zeros for a query
    with no visible key.

    ``scales``: k/v are an FP8 cache's E4M3 codes and these its (k_scale, v_scale) [KV]; every path reads
    the keys and values ``dequantize_kv`` gives (the Triton kernel as it loads each tile).
    """
    path = attention_path(q.device, q.dtype)
    paged = slots is not None and slots.dim() == 2  # (block tables: the kernel takes bounds only)
    if path == "triton" and triton_attention_fits(q, k, v) and _triton_ops_available() and \
            (not paged or isinstance(mask, KeyBounds)):
        from muse_spark.plugins import triton_ops  # (imported by _triton_ops_available)

        return triton_ops.attention(q, k, v, mask, slots, scales)  # picks the op for the mask's form
    if isinstance(mask, KeyBounds):
        mask = mask.dense()
    k, v = cache_rows(k, v, mask, slots, scales, q.dtype)
    if path == "reference":
        return attend_reference(q, k, v, mask)
    return _attend_sdpa(q, k, v, mask)


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``attend`` through ``F.scaled_dot_product_attention``. The ``rep`` query heads of a KV head
    become one sequence of rep·S queries over that head's keys (the mask depends on the query's
    position only), so K/V are neither expanded nor copied for GQA; eager and the compiled packages
    call the same SDPA kernel, so the engine stays equal to eager bit for bit."""
    B, S, H, dh = q.shape
    T, kv = k.shape[1], k.shape[2]
    rep = H // kv
    visible = mask.any(1)[:, :, None, None]  # [B, T, 1, 1]: keys some query may read
    kt = torch.where(visible, k, 0.0).transpose(1, 2)  # [B, KV, T, Dh]
    vt = torch.where(visible, v, 0.0).transpose(1, 2)
    qg = q.view(B, S, kv, rep, dh).permute(0, 2, 3, 1, 4).reshape(B, kv, rep * S, dh)
    m = mask[:, None, None].expand(B, 1, rep, S, T).reshape(B, 1, rep * S, T)
    out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=m, scale=1.0 / math.sqrt(dh))
    out = out.view(B, kv, rep, S, dh).permute(0, 3, 1, 2, 4).reshape(B, S, H, dh)
    # A query with no visible key: zeros (the CUDA kernel averages the masked values instead).
    return torch.where(mask.any(-1)[:, :, None, None], out, 0.0)


def linear_path(device, dtype: torch.dtype, options: KernelOptions | None = None) -> str:
    """What ``linear`` runs for this device and compute dtype with few rows: ``options``' (default: the
    current ones) ``KernelOptions.linear`` (``triton`` or ``cublas``) on CUDA in bf16/fp16, else
    ``reference`` (``F.linear``; ROCm too). The Triton kernel takes ≤ 16 rows (batch 1–2); more rows
    always use cuBLAS."""
    fused = nvidia(device) and dtype in (torch.bfloat16, torch.float16)
    return (options or current_options()).linear if fused else "reference"


def _triton_linear_fits(x: torch.Tensor, w) -> bool:
    """Whether ``linear`` runs the skinny Triton kernel on ``w``: a bf16/fp16 weight (``linear_triton``), or an
    ``Fp8Weight`` (``linear_fp8_triton``, W8A16)."""
    return _triton_linear_fits_rows(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.dtype, x.device, w)


def _triton_linear_fits_rows(rows: int, k: int, dtype: torch.dtype, device: torch.device, w) -> bool:
    """``_triton_linear_fits`` for an x of ``rows`` rows of ``k`` columns in ``dtype`` on ``device``."""
    if linear_path(device, dtype) != "triton" or not _triton_ops_available():  # (imports Triton)
        return False
    from muse_spark.plugins.linear.triton_kernel import fits_rows

    if isinstance(w, Fp8Weight):
        return w.dtype == dtype and fits_rows(rows, k, dtype, w.weight, w.scale)
    return fits_rows(rows, k, dtype, w)


FP8 = torch.float8_e4m3fn


class Fp8Weight:
    """An FP8 (E4M3) projection weight as ``linear`` takes it: ``weight`` [out, in] float8_e4m3fn,
    ``scale`` [out, 1] float32 (per output channel; a per-tensor scale is held expanded), optional
    ``input_scale`` (a static activation scale, [] float32; the reference path does not use it).
    The weight it stands for is ``weight.float() * scale`` (``dequantize``).

    ``dtype`` is the compute dtype (the activations' and outputs' dtype, as a plain weight's dtype
    is), not the storage dtype (``weight.dtype``); ``shape`` is the weight's. Rows slice weight
    and scale together (``w[a:b]``: the k/v rows of the stacked projection)."""

    __slots__ = ("weight", "scale", "input_scale", "dtype")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        self.weight, self.scale, self.input_scale, self.dtype = weight, scale, input_scale, dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, rows: slice) -> "Fp8Weight":
        if not isinstance(rows, slice):
            raise TypeError("an Fp8Weight is sliced by rows (a slice)")
        return Fp8Weight(self.weight[rows], self.scale[rows], self.input_scale, self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``weight.float() * scale`` (exact in float32), rounded to ``dtype`` (default: float32)."""
        w = self.weight.float() * self.scale
        return w if dtype is None else w.to(dtype)


class Fp8Linear(nn.Module):
    """A decoder projection held in FP8: parameters ``weight`` (float8_e4m3fn [out, in]) and
    ``weight_scale`` (float32 [out, 1]), and with static activation scales ``input_scale`` (float32
    []), as the canonical state dict names them (``<proj>.weight``, ``<proj>.weight_scale``,
    ``<proj>.input_scale``). ``compute_dtype``: the dtype its products are computed in (the model's).
    The loader puts these in place of the ``nn.Linear`` projections a quantized checkpoint holds
    (``install``); nothing is dequantized at load."""

    def __init__(self, in_features: int, out_features: int, compute_dtype: torch.dtype, static: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.input_scale = (nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False) if static
                            else None)

    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.input_scale, self.compute_dtype)

    @classmethod
    def install(cls, root: nn.Module, path: str, compute_dtype: torch.dtype, static: bool) -> "Fp8Linear":
        """Replace the ``nn.Linear`` at ``path`` under ``root`` (``model.layers.0.self_attn.qkv_proj``) by an
        ``Fp8Linear`` of its shape (built on the current device: meta, before ``load_state_dict``)."""
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path)
        old = getattr(parent, name)
        if not isinstance(old, nn.Linear) or old.bias is not None:
            raise TypeError(f"{path} is not a bias-free nn.Linear projection: it cannot hold FP8 weights")
        new = cls(old.in_features, old.out_features, compute_dtype, static)
        setattr(parent, name, new)
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn weight, "
                f"per-channel scales, compute {self.compute_dtype}")


def proj_weight(proj: nn.Module) -> torch.Tensor | Fp8Weight:
    """What ``linear`` takes for a projection module: its weight, or an ``Fp8Linear``'s ``Fp8Weight``."""
    return proj.fp8() if isinstance(proj, Fp8Linear) else proj.weight


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, silu_mul: bool = False) -> torch.Tensor:
    """The W8A16 spec: ``x @ (w.weight.float() * w.scale).T`` computed in x's dtype (the weight
    dequantized per call, exactly in float32, then rounded to x's dtype; the product as ``F.linear``
    in x's dtype); with ``silu_mul``, ``silu(g) · u`` of its halves. What runs without FP8 tensor cores; the skinny
    W8A16 kernel for few rows is checked against it; W8A8 has its own spec, ``fp8_w8a8_reference``."""
    return linear_reference(x, w.dequantize(x.dtype), silu_mul)


def fp8_w8a8_reference(x: torch.Tensor, w: Fp8Weight, silu_mul: bool = False) -> torch.Tensor:
    """The W8A8 spec (``plugins.linear.reference.w8a8_reference``: x's rows quantized by ``quantize_rows``, the
    product of the dequantized codes accumulated in float32, rounded once) of an ``Fp8Weight``;
    ``fp8_linear_w8a8`` and the skinny kernel's W8A8 form are checked against it."""
    return w8a8_reference(x, w.weight, w.scale, w.input_scale, silu_mul)


def fp8_linear_w8a8(x: torch.Tensor, w: Fp8Weight, silu_mul: bool = False) -> torch.Tensor:
    """W8A8: x's rows quantized to E4M3 (``quantize_rows``) and one ``torch._scaled_mm`` with row-wise scales
    (the activations' per row, the weight's per output channel), accumulated in float32, out in x's dtype.
    What ``linear`` runs for an ``Fp8Weight`` on Hopper/Ada when the skinny kernel does not take the rows
    (prefill, verification at batch > 2); its spec is ``fp8_w8a8_reference``."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2, w.input_scale)
    y = torch._scaled_mm(xq, w.weight.T, scale_a=xs, scale_b=w.scale.reshape(1, -1), out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], -1)
    return silu_mul_halves(y) if silu_mul else y


def fp8_tensor_cores(device) -> bool:
    """Whether ``device`` multiplies FP8 operands on its tensor cores: an NVIDIA GPU of compute capability ≥ 8.9
    (Ada, Hopper and later)."""
    return nvidia(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _w8a8_fits(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether ``linear`` runs ``fp8_linear_w8a8`` on ``w``: bf16 activations on a GPU with FP8 tensor cores,
    dims that ``torch._scaled_mm`` takes (multiples of 16) and at least one row."""
    if not (x.dtype == torch.bfloat16 and w.dtype == x.dtype and fp8_tensor_cores(x.device)):
        return False
    n, k = w.weight.shape
    return n % 16 == 0 and k % 16 == 0 and x.numel() > 0 and w.weight.is_contiguous()


def _fp8_w8a8_form(x: torch.Tensor) -> bool:
    """Whether the skinny kernel runs an ``Fp8Weight`` on ``x`` in its W8A8 form (dynamic per-token activation
    scales, or the checkpoint's static ``input_scale``): on FP8 tensor cores. The compiled 8B FP8 step at batch 1
    took 5.95 ms in this form against 6.55 in W8A16 (H100, 2026-12-06); W8A16 stays for GPUs without them."""
    return fp8_tensor_cores(x.device)


def _folds_w8a8_rows(stream: torch.Tensor, w) -> bool:
    """Whether the residual kernel that norms rows shaped as ``stream`` also quantizes them for ``w``'s product
    (``gated_residual_add_rows_triton``, then ``linear_w8a8_triton(rows=)``: no quantizing kernel of their own): an
    ``Fp8Weight`` that ``linear`` runs in the skinny kernel's W8A8 form, in a graph of the Triton plugins (the
    compiled engines'). The same bits as quantizing the normed rows after the residual kernel."""
    if not isinstance(w, Fp8Weight) or dispatch.current_impl() != "triton" or stream.device.type != "cuda":
        return False
    return _fp8_w8a8_form(stream) and _triton_linear_fits_rows(stream.numel() // stream.shape[-1], stream.shape[-1],
                                                                w.dtype, stream.device, w)


def _fp8_linear(x: torch.Tensor, w: Fp8Weight, silu_mul: bool) -> torch.Tensor:
    """An ``Fp8Weight``'s product: the skinny kernel for few rows (W8A8 on FP8 tensor cores, else W8A16), W8A8
    ``torch._scaled_mm`` for more on FP8 hardware, else the W8A16 reference."""
    if _triton_linear_fits(x, w):
        if _fp8_w8a8_form(x):
            return torch.ops.muse_spark.linear_w8a8_triton(x, w.weight, w.scale, silu_mul, w.input_scale)
        return torch.ops.muse_spark.linear_fp8_triton(x, w.weight, w.scale, silu_mul)
    if _w8a8_fits(x, w):
        return fp8_linear_w8a8(x, w, silu_mul)
    return fp8_linear_reference(x, w, silu_mul)


_INPUT_OBSERVERS: list = []  # (process-wide, not per thread: calibration is an offline run of its own)


@contextlib.contextmanager
def observe_linear_inputs(observer):
    """Within: every eager projection's product (``linear``, ``linear_silu_mul``, the qkv projection that writes the
    RoPE table) first calls ``observer(weight, x)`` with the weight as passed (a view of a module's weight for a
    part of it) and its input: what ``muse-spark quantize --calibrate`` measures its activation scales from.
    Compiled code (torch.compile, export) never observes."""
    _INPUT_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _INPUT_OBSERVERS.remove(observer)


def _observe(x: torch.Tensor, w) -> None:
    if _INPUT_OBSERVERS and not torch.compiler.is_compiling():
        _INPUT_OBSERVERS[-1](w, x)


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias). With few rows (≤ 16: a speculative step at batch 1–2) in bf16/fp16
    on CUDA, unless ``KernelOptions.linear`` is ``cublas``: the skinny Triton kernel, in the eager engine and the
    compiled packages alike; otherwise cuBLAS (or the CPU's GEMM). An ``Fp8Weight``: the same skinny kernel where
    it fits, in W8A8 form on FP8 tensor cores (``linear_w8a8_triton``: the rows quantized per token, FP8 MMA
    operands), else dequantizing its tiles as they stream in (``linear_fp8_triton``, W8A16, bit for bit the kernel
    on the dequantized weight); more rows in bf16 on FP8 hardware W8A8 (``fp8_linear_w8a8``); else the W8A16
    reference (``fp8_linear_reference``)."""
    _observe(x, w)
    if isinstance(w, Fp8Weight):
        return _fp8_linear(x, w, False)
    if _triton_linear_fits(x, w):
        return torch.ops.muse_spark.linear_triton(x, w, False)
    return linear_reference(x, w)


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``silu(g) · u`` of ``[g | u] = F.linear(x, w)``, each rounded to x's dtype as the plain modules
    round them; one kernel (the gate/up output never stored) where ``linear`` takes the Triton path.
    An ``Fp8Weight``: the skinny kernel's W8A8 or W8A16 form, ``fp8_linear_w8a8`` or ``fp8_linear_reference``, as
    ``linear``."""
    _observe(x, w)
    if isinstance(w, Fp8Weight):
        return _fp8_linear(x, w, True)
    if _triton_linear_fits(x, w):
        return torch.ops.muse_spark.linear_triton(x, w, True)
    return linear_reference(x, w, True)


class Attention(nn.Module):
    def __init__(self, cfg: MuseSpark1xConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.qkv_out, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.pre_qkv_proj_norm = make_norm(cfg)
        if cfg.fp8_kv_cache:  # the FP8 KV cache's float32 scales per KV head: code = x / scale, x = code · scale
            self.register_buffer("k_scale", torch.ones(cfg.num_key_value_heads, dtype=torch.float32))
            self.register_buffer("v_scale", torch.ones(cfg.num_key_value_heads, dtype=torch.float32))

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [KV] float32 of an FP8 KV cache; None where the caches hold the compute dtype."""
        return (self.k_scale, self.v_scale) if self.cfg.fp8_kv_cache else None

    def kv_weight(self) -> torch.Tensor:
        """The k and v rows of the stacked projection, [2·KV·Dh, D]."""
        q = self.cfg.q_size
        return proj_weight(self.qkv_proj)[q : q + 2 * self.cfg.kv_size]

    def normalize_heads(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-head weightless RMS norm, then RoPE at ``positions``. x: [B, S, heads, Dh] (q and k of
        a step side by side, or the draft's context keys)."""
        c = self.cfg
        return head_norm_rope(x, positions, c.rms_norm_eps, c.rope_theta, c.use_rope)

    @staticmethod
    def writes_cache(qk: torch.Tensor, kv: KVProvider, positions: torch.Tensor) -> bool:
        """Whether the q/k norm kernel writes the layer's K/V into the caches itself (bf16/fp16 on
        CUDA, a ``CacheKV`` at the layer's own positions): one launch instead of three."""
        return (CacheKV.at(kv, positions, qk.dtype) and qk.device.type == "cuda" and _triton_ops_available()
                and _head_norm_rope_fits(qk))

    def attends_from_cache_write(self, qk: torch.Tensor, kv: KVProvider, positions: torch.Tensor) -> bool:
        """Whether one kernel norms and rotates q/k, writes K/V into the caches and attends
        (``muse_spark::attention_cache_triton``, the attention's partial kernel with
        ``head_norm_rope_cache``'s work folded in): with ``KernelOptions.attention_cache``, where
        ``writes_cache`` holds, the Triton attention kernel is the one chosen and fits, and the mask
        is in bounds form."""
        if not (current_options().attention_cache and self.writes_cache(qk, kv, positions)
                and isinstance(kv.mask, KeyBounds)
                and attention_path(qk.device, qk.dtype) == "triton"):
            return False
        q = qk[:, :, : self.cfg.num_attention_heads]
        return triton_attention_fits(q, kv.k_cache, kv.v_cache)

    def takes_rope_table(self, x: torch.Tensor, kv: KVProvider, positions: torch.Tensor) -> bool:
        """Whether the qkv projection also writes the step's RoPE table for the q/k norm kernel
        (``muse_spark::linear_rope_table_triton``; an FP8 weight's ``linear_fp8_rope_table_triton`` where ``linear``
        takes its W8A8 form: a W8A16 qkv projection with the table broke AOTInductor's C++ wrapper on an H100,
        2026-12-06): with ``KernelOptions.rope_table`` and RoPE,
        where ``linear`` takes the Triton kernel and the norm kernel will write the caches (a
        ``CacheKV`` at the layer's positions, bf16/fp16 on CUDA, a power-of-two head_dim). Where the
        fused attention kernel takes the layer (the default, ``attends_from_cache_write``) it reads it instead."""
        c = self.cfg
        w = proj_weight(self.qkv_proj)
        return (current_options().rope_table and c.use_rope and x.dim() == 3
                and positions.numel() == x.shape[0] * x.shape[1] and CacheKV.at(kv, positions, x.dtype)
                and _triton_linear_fits(x, w) and (not isinstance(w, Fp8Weight) or _fp8_w8a8_form(x))
                and _head_norm_rope_fits_heads(x.dtype, c.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVProvider, project: bool = True) -> torch.Tensor:
        # x: [B, S, D] normed input (compute dtype); positions: [B, S]; project=False: the output
        # before ``o_proj`` (the layer projects it together with the residual after it)
        c = self.cfg
        B, S, _ = x.shape
        H = c.num_attention_heads
        table = {}
        w = proj_weight(self.qkv_proj)
        if not self.takes_rope_table(x, kv, positions):
            qkv = linear(x, w)
        else:  # the projection's launch also writes the RoPE table
            _observe(x, w)
            if isinstance(w, Fp8Weight):  # (W8A8, the form linear() takes here: takes_rope_table)
                qkv, table["rope_cos"], table["rope_sin"] = torch.ops.muse_spark.linear_fp8_rope_table_triton(
                    x, w.weight, w.scale, positions, c.rope_theta, c.head_dim, True, w.input_scale)
            else:
                qkv, table["rope_cos"], table["rope_sin"] = torch.ops.muse_spark.linear_rope_table_triton(
                    x, w, positions, c.rope_theta, c.head_dim)
        qs, kvs = c.q_size, c.kv_size
        # q and k side by side, [B, S, H + KV, Dh]: one normalization for both
        qk = qkv[..., : qs + kvs].reshape(B, S, H + c.num_key_value_heads, c.head_dim)
        v = qkv[..., qs + kvs : qs + 2 * kvs].reshape(B, S, c.num_key_value_heads, c.head_dim)
        if self.attends_from_cache_write(qk, kv, positions):  # norm, cache write and attention: one kernel
            from muse_spark.plugins import triton_ops  # (imported by _triton_ops_available)

            out = triton_ops.attention_cache(qk, v, positions, c.rms_norm_eps, c.rope_theta, c.use_rope,
                                             kv.k_cache, kv.v_cache, kv.slots, kv.mask, **table, scales=kv.scales)
            return self._output(out.reshape(B, S, c.q_size), qkv, project)
        if self.writes_cache(qk, kv, positions):  # the norm kernel stores k and v into the caches
            ks, vs = kv.scales or (None, None)  # (an FP8 cache's: the kernel quantizes as it writes)
            q = torch.ops.muse_spark.head_norm_rope_cache_triton(qk, v, positions, c.rms_norm_eps, c.rope_theta,
                                                                 c.use_rope, kv.k_cache, kv.v_cache, kv.slots,
                                                                 **table, k_scale=ks, v_scale=vs)
            keys, values, mask, slots = kv.attended()
        else:
            qk = self.normalize_heads(qk, positions)
            keys, values, mask, slots = kv(qk[:, :, H:], v)
            q = qk[:, :, :H]
        scales = getattr(kv, "scales", None)  # (an FP8 cache's: the layer's k_scale/v_scale)
        return self._output(attend(q, keys, values, mask, slots, scales).reshape(B, S, c.q_size), qkv, project)

    def _output(self, out: torch.Tensor, qkv: torch.Tensor, project: bool) -> torch.Tensor:
        """The attention's output [B, S, q_size] gated (``attn_output_gate``: the gate rows of ``qkv``)
        and, with ``project``, projected."""
        c = self.cfg
        if c.attn_output_gate:
            gate = qkv[..., c.q_size + 2 * c.kv_size :]
            out = (out.float() * torch.sigmoid(gate.float())).to(out.dtype)
        return linear(out, proj_weight(self.o_proj)) if project else out


class FeedForward(nn.Module):
    def __init__(self, cfg: MuseSpark1xConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(linear_silu_mul(x, proj_weight(self.gate_up_proj)), proj_weight(self.down_proj))


class DecoderLayer(nn.Module):
    """Muse layer with the materialized, gated FP32 residual (vLLM's Muse Spark DSpark decoder layer's forward)."""

    def __init__(self, cfg: MuseSpark1xConfig):
        super().__init__()
        self.cfg = cfg
        self.self_attn = Attention(cfg)
        self.post_attn_norm = make_norm(cfg)
        self.pre_ffn_norm = make_norm(cfg)
        self.post_ffn_norm = make_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        # Raw gates as stored in the checkpoint (ones when absent) …
        self.register_buffer("attn_residual_gate", torch.ones(cfg.hidden_size))
        self.register_buffer("ffn_residual_gate", torch.ones(cfg.hidden_size))
        # … and the materialized constants g = residual_multiplier · gate (fp32).
        self.register_buffer("g_attn", torch.ones(cfg.hidden_size), persistent=False)
        self.register_buffer("g_ffn", torch.ones(cfg.hidden_size), persistent=False)
        # Tensor parallelism (runtime/tensor_parallel.py): the process group whose ranks hold the
        # other slices of this layer; its o_proj/down_proj products are partial sums to all-reduce.
        self.tp_group = None

    def materialize_residual_constants(self) -> None:
        m = self.cfg.residual_multiplier
        self.g_attn = (m * self.attn_residual_gate.float()).contiguous()
        self.g_ffn = (m * self.ffn_residual_gate.float()).contiguous()

    def input_norm(self, stream: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This layer's normed input, ``pre_qkv_proj_norm`` of the stream in the compute dtype."""
        return self.self_attn.pre_qkv_proj_norm(stream.to(dtype), dtype)

    def forward(self, stream: torch.Tensor, positions: torch.Tensor, kv: KVProvider, x: torch.Tensor | None = None,
                next_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """stream [B, S, D] fp32 → (the new stream, ``next_norm`` of it in the compute dtype).

        ``x``: this layer's ``input_norm(stream)`` when the caller has it (the previous layer's
        ``next_norm`` output), else computed here. ``next_norm``: the norm that reads this layer's
        output (the next layer's input norm, or the model's final norm), fused into the last
        residual kernel; without it the second result is an empty tensor."""
        if x is None:
            x = self.input_norm(stream, proj_weight(self.self_attn.qkv_proj).dtype)
        attn = self.self_attn(x, positions, kv, project=False)
        # stream += g_attn ⊙ post_attn_norm(o_proj(attn)); x = pre_ffn_norm(stream)
        w_gu = proj_weight(self.feed_forward.gate_up_proj)
        if self.tp_group is None and _folds_w8a8_rows(stream, w_gu):  # (the residual kernel quantizes x for it)
            stream, ffn = self.residual_into_w8a8(stream, attn, proj_weight(self.self_attn.o_proj), w_gu)
        else:
            stream, x = self.residual(stream, attn, proj_weight(self.self_attn.o_proj), self.g_attn,
                                      self.pre_ffn_norm.weight, self.post_attn_norm.weight)
            ffn = linear_silu_mul(x, w_gu)
        # stream += g_ffn ⊙ post_ffn_norm(down_proj(ffn)); x_next = next_norm(stream)
        return self.residual(stream, ffn, proj_weight(self.feed_forward.down_proj), self.g_ffn,
                             next_norm.weight if next_norm is not None else None, self.post_ffn_norm.weight,
                             apply_norm=next_norm is not None)

    def residual_into_w8a8(self, stream: torch.Tensor, attn: torch.Tensor, w_o, w_gu: Fp8Weight
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's residual and the feed-forward's gate/up product where ``_folds_w8a8_rows``: the residual
        kernel also writes pre_ffn_norm(stream)'s rows as E4M3 codes and scales, which the W8A8 product takes as
        they are. → (the new stream, silu(g) · u)."""
        from muse_spark.plugins import triton_ops  # (imported by _folds_w8a8_rows)

        c = self.cfg
        stream, x, q, qs = triton_ops.gated_residual_add_rows(
            stream, linear(attn, w_o), self.g_attn, self.pre_ffn_norm.weight, c.rms_norm_eps,
            c.norm_zero_centered_gamma, w_o.dtype, self.post_attn_norm.weight, True, w_gu.input_scale)
        _observe(x, w_gu)
        return stream, torch.ops.muse_spark.linear_w8a8_triton(x, w_gu.weight, w_gu.scale, True, w_gu.input_scale,
                                                               q, qs)

    def residual(self, stream: torch.Tensor, branch_in: torch.Tensor, w: torch.Tensor, gate: torch.Tensor,
                 norm_weight: torch.Tensor | None, branch_norm_weight: torch.Tensor | None,
                 apply_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """stream + gate ⊙ branch_norm(branch_in @ wᵀ) and its norm (``norm_weight``; none without
        ``apply_norm``): the projection, then one gated residual plugin call."""
        c = self.cfg
        if self.tp_group is None:
            proj = linear(branch_in, w)
        else:  # this rank's partial product, summed over the ranks in FP32, rounded once as the whole GEMM is
            # (an FP8 weight: dequantized and rounded to the compute dtype, as the W8A16 reference rounds it)
            wf = w.dequantize(w.dtype).float() if isinstance(w, Fp8Weight) else w.float()
            # (a functional collective: traceable, so a compiled rank's package holds the all-reduce)
            proj = all_reduce(torch.nn.functional.linear(branch_in.float(), wf), self.tp_group).to(w.dtype)
        return dispatch.gated_residual_add(stream, proj, gate, norm_weight, c.rms_norm_eps,
                                           c.norm_zero_centered_gamma, apply_norm, w.dtype, branch_norm_weight, True)


