"""A wide-vocabulary target checkpoint (~130 MB) for the memory test."""

import json

import torch
from safetensors.torch import save_file

from muse_spark.builder.tiny import tiny_configs


def write_wide_checkpoint(tmp_path, vocab=65536, hidden=512):
    cfg = dict(tiny_configs()[0], vocab_size=vocab, hidden_size=hidden, head_dim=16, intermediate_size=64,
               num_hidden_layers=1, bos_token_id=None, eos_token_id=[0], pad_token_id=None)
    d = tmp_path / "wide"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    h, kv, dh, f = cfg["num_attention_heads"], cfg["num_key_value_heads"], 16, 64
    t = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden),
        "lm_head.weight": torch.randn(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(h * dh, hidden),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * dh, hidden),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(kv * dh, hidden),
        "model.layers.0.self_attn.o_gate_proj.weight": torch.randn(h * dh, hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, h * dh),
        "model.layers.0.feed_forward.gate_proj.weight": torch.randn(f, hidden),
        "model.layers.0.feed_forward.up_proj.weight": torch.randn(f, hidden),
        "model.layers.0.feed_forward.down_proj.weight": torch.randn(hidden, f),
    }
    for n in ("self_attn.pre_qkv_proj_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm"):
        t[f"model.layers.0.{n}.weight"] = torch.ones(hidden)
    t = {k: v.bfloat16() for k, v in t.items()}
    save_file(t, str(d / "model.safetensors"))
    return d, sum(v.numel() * 2 for v in t.values())
