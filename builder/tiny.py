"""Tiny Muse Spark + DSpark checkpoint pairs, generated locally (no downloads).

``make_tiny(out, kind)`` writes ``out/target`` and ``out/draft`` as HF-style
checkpoints (config.json, model.safetensors with vLLM's *unstacked* names,
tokenizer.json) in small odd sizes, so every shape bug shows up.

* ``random``: all weights random; the draft rarely agrees with the target.
  Good for losslessness tests (every rejection path runs).
* ``agreeing``: the target is built to be (almost) a bigram model whose greedy
  next token is ``f(token)`` for a fixed permutation ``f`` of the draft
  vocabulary's tokens, and the draft's Markov head encodes the same bigram, so
  the greedy draft mostly matches the target and multi-token acceptance
  really happens.

The byte-level tokenizer has 256 byte tokens plus ``<|bos|>``, ``<|eos|>``,
``<|mask|>`` (vocab 259).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 259
BOS, EOS, MASK = 256, 257, 258
DRAFT_VOCAB = 131
HIDDEN = 64
SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>")


def tiny_configs(gamma: int = 5, markov_rank: int = 32, head_type: str = "vanilla",
                 confidence: bool = True, dtype: str = "bfloat16") -> tuple[dict, dict]:
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, norm_affine=True, norm_zero_centered_gamma=False, use_rope=True, rope_theta=10000.0,
        max_position_embeddings=1024, attn_output_gate=True, residual_dtype="float32", torch_dtype=dtype,
        residual_multiplier=1.0, metap={"use_metap": True, "router_has_one_inf_dim": True, "base_width": 32,
                                        "metap_mode": "sp"},
        output_soft_cap_temp=30.0, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=[EOS],
        pad_token_id=EOS,
    )
    target = dict(common, architectures=["MuseSpark1xForCausalLM"], intermediate_size=96, num_hidden_layers=4)
    draft = dict(
        common, architectures=["MuseSparkDSparkForCausalLM"], intermediate_size=80, num_hidden_layers=2,
        draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN, target_layer_ids=[0, 2], mask_token_id=MASK,
        block_size=gamma, sample_from_anchor=True, causal=True, markov_rank=markov_rank,
        markov_head_type=head_type, enable_confidence_head=confidence, confidence_head_with_markov=confidence,
        dspark_draft_topk=None,
    )
    return target, draft


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


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order the vocab by byte value.
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _byte_of(ch: str) -> int:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(cs, bs))[ord(ch)]


def make_tiny(out: str | Path, kind: str = "agreeing", seed: int = 0, gamma: int = 5,
              head_type: str = "vanilla", dtype: str = "bfloat16") -> dict:
    """Write ``out/target`` and ``out/draft``; return a summary dict."""
    if kind not in ("random", "agreeing"):
        raise ValueError(f"make-tiny: unknown kind {kind!r} (expected 'random' or 'agreeing')")
    out = Path(out)
    g = torch.Generator().manual_seed(seed)
    tcfg, dcfg = tiny_configs(gamma=gamma, head_type=head_type, dtype=dtype)
    d, r = HIDDEN, dcfg["markov_rank"]
    agreeing = kind == "agreeing"
    # Draft vocabulary: a sorted subset of ordinary byte tokens (no specials): all
    # printable ASCII bytes plus random others, so demo text stays readable.
    printable = torch.arange(32, 127)
    others = torch.tensor([b for b in range(256) if not 32 <= b < 127])
    extra = others[torch.randperm(len(others), generator=g)[: DRAFT_VOCAB - len(printable)]]
    draft_ids = torch.sort(torch.cat([printable, extra])).values
    d2t = draft_ids - torch.arange(DRAFT_VOCAB)

    # ---- target ------------------------------------------------------------------------
    # agreeing: layers barely move the stream, so the target is nearly a bigram model.
    layer_scale, gate_scale = (0.1, 0.02) if agreeing else (0.15, 0.5)
    tt: dict[str, torch.Tensor] = {}
    embed = torch.randn(VOCAB, d, generator=g)
    tt["model.embed_tokens.weight"] = embed
    for i in range(tcfg["num_hidden_layers"]):
        tt.update(_layer_tensors(f"model.layers.{i}", tcfg, g, layer_scale, gate_scale))
    tt["model.norm.weight"] = 1 + torch.randn(d, generator=g) * 0.1
    if agreeing:
        # Bigram: the greedy successor of draft-vocab token s is f(s) (a permutation
        # of the draft vocabulary): lm_head row f(s) points along embed[s].
        # f permutes the printable bytes among themselves and the others among themselves.
        is_pr = (draft_ids >= 32) & (draft_ids < 127)
        perm = draft_ids.clone()
        for sel in (is_pr, ~is_pr):
            idx = sel.nonzero().flatten()
            perm[idx] = draft_ids[idx[torch.randperm(len(idx), generator=g)]]
        lm = torch.randn(VOCAB, d, generator=g) * 0.05
        lm[perm] = embed[draft_ids] / embed[draft_ids].norm(dim=-1, keepdim=True) * 2.0
        succ = dict(zip(draft_ids.tolist(), perm.tolist()))
    else:
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
    if agreeing:
        # W2[dj] · W1[s] is large when target(dj) == f(s).
        inv = {v: k for k, v in succ.items()}
        w2 = torch.stack([w1[inv[int(t)]] for t in draft_ids]) * 12.0
        # Swap a few row pairs so that ~15 % of the draft's bigrams are wrong:
        # acceptance is high but partial, and the rejection path runs too.
        swap = torch.randperm(DRAFT_VOCAB, generator=g)[: 2 * (DRAFT_VOCAB * 15 // 200)].view(-1, 2)
        w2[swap[:, 0]], w2[swap[:, 1]] = w2[swap[:, 1]].clone(), w2[swap[:, 0]].clone()
        dt_["lm_head.weight"] = torch.randn(DRAFT_VOCAB, d, generator=g) * 0.05
    else:
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

    tok = make_tokenizer()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    for sub, cfg, tensors in (("target", tcfg, tt), ("draft", dcfg, dt_)):
        p = out / sub
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        conv = {k: (v.to(torch_dtype) if v.is_floating_point() and "residual_gate" not in k else v).contiguous()
                for k, v in tensors.items()}
        save_file(conv, str(p / "model.safetensors"))
        tok.save(str(p / "tokenizer.json"))
    return {"out": str(out), "kind": kind, "seed": seed, "gamma": gamma}
