"""Tiny Muse Spark + DSpark checkpoint pairs, generated locally (no downloads).

``make_tiny(out, kind)`` writes ``out/target`` and ``out/draft`` as HF-style
checkpoints (config.json, model.safetensors with vLLM's *unstacked* names,
tokenizer.json) in small odd sizes, so every shape bug shows up.

* ``random``: all weights random; the draft rarely agrees with the target.
  Good for losslessness tests (every rejection path runs).
* ``agreeing``: ``make-pair``'s construction at the tiny preset (builder/pair.py):
  the target is a bigram model and the draft's Markov head encodes the same
  bigram except on 15 % of the draft tokens, so multi-token acceptance really
  happens and the rejection path runs too.

The byte-level tokenizer has 256 byte tokens plus ``<|bos|>``, ``<|eos|>``,
``<|mask|>`` (vocab 259).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from muse_spark.builder.pair import make_pair, make_tokenizer, preset_configs, write_tokenizer_config

VOCAB = 259
DRAFT_VOCAB = 131
HIDDEN = 64
AGREEING_RATE = 0.85  # make-tiny --kind agreeing: the rate at which drafted tokens agree with the target


def tiny_configs(gamma: int = 5, markov_rank: int = 32, head_type: str = "vanilla",
                 confidence: bool = True, dtype: str = "bfloat16") -> tuple[dict, dict]:
    return preset_configs("tiny", gamma=gamma, markov_rank=markov_rank, head_type=head_type, confidence=confidence,
                          dtype=dtype)


def _layer_tensors(prefix: str, cfg: dict, g: torch.Generator, scale: float, gate_scale: float) -> dict:
    d, h, kv, dh, f = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                       cfg["head_dim"], cfg["intermediate_size"])

    def rnd(*shape, s=scale):
        return torch.randn(*shape, generator=g) * s

    t = {
        f"{prefix}.self_attn.q_proj.weight": rnd(h * dh, d),
        f"{prefix}.self_attn.k_proj.weight": rnd(kv * dh, d),
        f"{prefix}.self_attn.v_proj.weight": rnd(kv * dh, d),
        f"{prefix}.self_attn.o_proj.weight": rnd(d, h * dh),
        f"{prefix}.self_attn.pre_qkv_proj_norm.weight": 1 + rnd(d, s=0.1),
        f"{prefix}.post_attn_norm.weight": 1 + rnd(d, s=0.1),
        f"{prefix}.pre_ffn_norm.weight": 1 + rnd(d, s=0.1),
        f"{prefix}.post_ffn_norm.weight": 1 + rnd(d, s=0.1),
        f"{prefix}.feed_forward.gate_proj.weight": rnd(f, d),
        f"{prefix}.feed_forward.up_proj.weight": rnd(f, d),
        f"{prefix}.feed_forward.down_proj.weight": rnd(d, f),
        # The post-norms give each branch unit RMS: the gates set its weight.
        f"{prefix}.attn_residual_gate": gate_scale * (0.5 + torch.rand(d, generator=g)),
        f"{prefix}.ffn_residual_gate": gate_scale * (0.5 + torch.rand(d, generator=g)),
    }
    if cfg["attn_output_gate"]:
        t[f"{prefix}.self_attn.o_gate_proj.weight"] = rnd(h * dh, d)
    return t


def make_tiny(out: str | Path, kind: str = "agreeing", seed: int = 0, gamma: int = 5,
              head_type: str = "vanilla", dtype: str = "bfloat16") -> dict:
    """Write ``out/target`` and ``out/draft``; return a summary dict."""
    if kind not in ("random", "agreeing"):
        raise ValueError(f"make-tiny: unknown kind {kind!r} (expected 'random' or 'agreeing')")
    if kind == "agreeing":  # the construction of make-pair at the tiny preset
        make_pair(out, "tiny", acceptance=AGREEING_RATE, seed=seed, gamma=gamma, head_type=head_type, dtype=dtype,
                  overwrite=True)
        return {"out": str(out), "kind": kind, "seed": seed, "gamma": gamma}
    out = Path(out)
    g = torch.Generator().manual_seed(seed)
    tcfg, dcfg = tiny_configs(gamma=gamma, head_type=head_type, dtype=dtype)
    d, r = HIDDEN, dcfg["markov_rank"]
    # Draft vocabulary: a sorted subset of ordinary byte tokens (no specials): all
    # printable ASCII bytes plus random others, so demo text stays readable.
    printable = torch.arange(32, 127)
    others = torch.tensor([b for b in range(256) if not 32 <= b < 127])
    extra = others[torch.randperm(len(others), generator=g)[: DRAFT_VOCAB - len(printable)]]
    draft_ids = torch.sort(torch.cat([printable, extra])).values
    d2t = draft_ids - torch.arange(DRAFT_VOCAB)

    # ---- target ------------------------------------------------------------------------
    layer_scale, gate_scale = 0.15, 0.5
    tt: dict[str, torch.Tensor] = {}
    embed = torch.randn(VOCAB, d, generator=g)
    tt["model.embed_tokens.weight"] = embed
    for i in range(tcfg["num_hidden_layers"]):
        tt.update(_layer_tensors(f"model.layers.{i}", tcfg, g, layer_scale, gate_scale))
    tt["model.norm.weight"] = 1 + torch.randn(d, generator=g) * 0.1
    lm = torch.randn(VOCAB, d, generator=g) * 0.3
    tt["lm_head.weight"] = lm

    # ---- draft -------------------------------------------------------------------------
    dt_: dict[str, torch.Tensor] = {}
    dt_["fc.weight"] = torch.randn(d, d * len(dcfg["target_layer_ids"]), generator=g) * 0.1
    dt_["hidden_norm.weight"] = 1 + torch.randn(d, generator=g) * 0.1
    for i in range(dcfg["num_hidden_layers"]):
        dt_.update(_layer_tensors(f"layers.{i}", dcfg, g, 0.15, 0.5))
    dt_["norm.weight"] = 1 + torch.randn(d, generator=g) * 0.1
    w1 = torch.randn(VOCAB, r, generator=g) / r**0.5
    w2 = torch.randn(DRAFT_VOCAB, r, generator=g) * 0.5
    dt_["lm_head.weight"] = torch.randn(DRAFT_VOCAB, d, generator=g) * 0.3
    dt_["markov_head.markov_w1.weight"] = w1
    dt_["markov_head.markov_w2.weight"] = w2
    if head_type == "gated":
        dt_["markov_head.gate_proj.weight"] = torch.randn(r, d + r, generator=g) * 0.05
        dt_["markov_head.gate_proj.bias"] = torch.full((r,), 3.0)
    elif head_type == "rnn":
        dt_["markov_head.joint_proj.weight"] = torch.randn(3 * r, 2 * r + d, generator=g) * 0.05
        dt_["markov_head.joint_proj.bias"] = torch.zeros(3 * r)
    if dcfg["enable_confidence_head"]:
        dt_["confidence_head.proj.weight"] = torch.randn(1, d + r, generator=g) * 0.1
        dt_["confidence_head.proj.bias"] = torch.zeros(1)
    dt_["d2t"] = d2t
    dt_["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_ids, True)  # ignored by the loader

    tok = make_tokenizer(VOCAB)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    for sub, cfg, tensors in (("target", tcfg, tt), ("draft", dcfg, dt_)):
        p = out / sub
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        conv = {k: (v.to(torch_dtype) if v.is_floating_point() and "residual_gate" not in k else v).contiguous()
                for k, v in tensors.items()}
        save_file(conv, str(p / "model.safetensors"))
        tok.save(str(p / "tokenizer.json"))
        write_tokenizer_config(p)
    return {"out": str(out), "kind": kind, "seed": seed, "gamma": gamma}
