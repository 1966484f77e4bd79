"""The benchmark pairs: Muse-Spark-shaped target + DSpark draft configurations with random weights,
and the step's weight GEMMs alone (the GEMM floor).

``PRESETS``: ``muse-spark-8b`` (an 8B-shaped dense target, a 5-layer DSpark draft) and ``tiny`` (the
same code paths at toy size, for CPU smoke runs). ``random_pair`` generates the weights on the
device (an 8B pair is 16 GB); acceptance on random weights says nothing about a trained pair.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import time_fn, time_in_graph  # noqa: E402  (benchmarks/timing.py, beside this file)

PRESETS = {
    # An 8B-shaped dense target and a 5-layer DSpark draft.
    "muse-spark-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=131072,
                          draft_layers=5, draft_vocab=32768, rank=256, gamma=7, aux=(1, 8, 15, 22, 29)),
    # Same code paths at toy size (CPU smoke runs, CI).
    "tiny": dict(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                 draft_layers=1, draft_vocab=128, rank=16, gamma=3, aux=(0, 1)),
}
# Mean acceptance lengths (tokens per step, bonus included) the tokens/s figures are given at.
TAUS = (1.0, 3.7, 6.17)


def preset_configs(name: str, layers: int | None = None, draft_layers: int | None = None):
    from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig

    p = dict(PRESETS[name])
    if layers:
        p["layers"] = layers
        p["aux"] = tuple(sorted({min(a, max(layers - 2, 0)) for a in p["aux"]}))  # the last layer is excluded
    if draft_layers:
        p["draft_layers"] = draft_layers
    common = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                  num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate_size=p["ffn"],
                  torch_dtype="bfloat16", attn_output_gate=False, output_soft_cap_temp=None, eos_token_id=[2],
                  max_position_embeddings=8192, rope_theta=500000.0)
    t = MuseSpark1xConfig.from_dict(dict(common, num_hidden_layers=p["layers"]), "bench target")
    d = MuseSparkDSparkConfig.from_dict(dict(
        common, num_hidden_layers=p["draft_layers"], draft_vocab_size=p["draft_vocab"],
        target_hidden_size=p["hidden"], target_layer_ids=list(p["aux"]), mask_token_id=3, block_size=p["gamma"],
        markov_rank=p["rank"], markov_head_type="vanilla"), "bench draft")
    d.validate_against(t)
    return t, d


def random_pair(tcfg, dcfg, device, seed: int = 0):
    """Reference modules with random weights, generated on the device (an 8B pair is 16 GB)."""
    import torch

    from muse_spark.checkpoint import expected_shapes
    from muse_spark.runtime.engine import build_modules

    g = torch.Generator(device=device).manual_seed(seed)

    def sd_for(cfg):
        sd = {}
        for name, shape in expected_shapes(cfg).items():
            if name == "draft_id_to_target_id":
                ids = torch.sort(torch.randperm(cfg.vocab_size, device=device, generator=g)[: cfg.draft_vocab_size]).values
                sd[name] = ids - torch.arange(cfg.draft_vocab_size, device=device)
            elif name.endswith("residual_gate"):
                sd[name] = 0.5 + torch.rand(shape, device=device, generator=g)
            elif name.endswith((".k_scale", ".v_scale")):  # (an FP8 KV cache's scales: vLLM's default, 1)
                sd[name] = torch.ones(shape, device=device)
            elif name.endswith("norm.weight"):
                sd[name] = 1 + 0.1 * torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
            else:
                sd[name] = 0.02 * torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
        return sd

    return build_modules(tcfg, dcfg, sd_for(tcfg), sd_for(dcfg), torch.bfloat16, device)




def step_matrices(target, draft) -> list:
    """The weight matrices a speculative step multiplies by, with the rows it multiplies:
    ``[(name, weight, "target"|"draft")]``. Every ``nn.Linear`` of both models (the target's
    lm_head is its embedding when tied) except the Markov head's, which the Markov loop reads; an FP8
    projection (``Fp8Linear``) as the ``Fp8Weight`` the engine multiplies by."""
    from torch import nn

    from muse_spark.models.layers import Fp8Linear, proj_weight

    def projections(module, who: str, keep=lambda n: True):
        return [(f"{who}.{n}", proj_weight(m), who) for n, m in module.named_modules()
                if isinstance(m, (nn.Linear, Fp8Linear)) and keep(n)]

    mats = projections(target, "target")
    if getattr(target, "lm_head", None) is None:
        mats.append(("target.embed_tokens (tied lm_head)", target.embed_tokens.weight, "target"))
    return mats + projections(draft, "draft", lambda n: "markov" not in n)


def weight_bytes(w) -> int:
    """Bytes a product reads of ``w``: a tensor's, or an ``Fp8Weight``'s codes and scales."""
    if hasattr(w, "scale"):
        return w.weight.numel() * w.weight.element_size() + w.scale.numel() * w.scale.element_size()
    return w.numel() * w.element_size()


def gemm_floor(target, draft, batch: int, gamma: int, device, iters: int, engine: bool = False) -> dict:
    """The step's weight GEMMs alone, back to back (captured in one CUDA graph on the GPU): the
    target's with B·(γ+1) rows, the draft's with B·γ. cuBLAS through ``F.linear``, or with
    ``engine`` the engine's own path (``models.layers.linear`` / ``linear_silu_mul``: the skinny
    Triton kernel with silu·mul fused for ≤ 16 rows by default; cuBLAS and a silu kernel under the
    kernel option ``linear="cublas"`` or for more rows; the current options'). What a step built on
    these GEMMs cannot beat, whatever it fuses around them. FP8 projections run the engine's path either way
    (``F.linear`` takes no FP8 weight)."""
    import torch
    import torch.nn.functional as F

    from muse_spark.models.layers import Fp8Weight, linear, linear_silu_mul

    mats = step_matrices(target, draft)
    rows = {"target": batch * (gamma + 1), "draft": batch * gamma}
    xs = {}
    for _, w, who in mats:
        key = (rows[who], w.shape[1], w.dtype)
        if key not in xs:
            xs[key] = torch.randn(key[0], key[1], device=device).to(w.dtype)
    calls = [(xs[(rows[who], w.shape[1], w.dtype)], w, engine and name.endswith("gate_up_proj"),
              linear if engine or isinstance(w, Fp8Weight) else F.linear) for name, w, who in mats]

    def run():
        for x, w, silu_mul, gemm in calls:
            linear_silu_mul(x, w) if silu_mul else gemm(x, w)

    with torch.inference_mode():
        if device.type == "cuda":
            us, how = time_in_graph([run], reps=1, replays=iters)
            r = {"median_ms": us / 1e3, "iters": iters}
        else:
            r, how = time_fn(run, device, iters), "eager"
    wbytes = sum(weight_bytes(w) for _, w, _ in mats)
    return dict(r, how=how, gemms=len(mats), weight_bytes=wbytes)
