"""Target + DSpark draft checkpoint pairs whose drafts agree with the target at a chosen rate.

``make_pair(out, preset, acceptance=P, confidence="informative"|"random", seed=S)`` writes ``out/target``
and ``out/draft`` as HF-style checkpoints at the preset's real shapes (``PRESETS``): ``config.json``,
safetensors shards of 2 GiB with ``model.safetensors.index.json`` (one ``model.safetensors`` where it
fits in one; vLLM's unstacked weight names), and a ``tokenizer.json``; ``out/pair.json`` records how the pair was made. The weights are generated on
the given device (the GPU: seconds for the 8B preset) one shard at a time, so the host holds one
shard, never the whole model.

The construction (docs/design.md, "Pairs with a chosen acceptance"):

* **The target is a bigram model.** Its layers barely move the residual stream (small residual
  gates), so the final hidden state points along the last token's embedding ``ê_s``, and its
  ``lm_head`` row ``j`` is ``α · Σ ê_s`` over the tokens ``s`` whose successor ``f(s)`` is ``j``.
  The greedy successor of every token is ``f(s)``, always a draft-vocabulary token; on the draft
  vocabulary ``f`` is one cycle through all its tokens in a random order, so greedy text walks
  that cycle.
* **The draft's Markov head encodes a bigram ``g``** that equals ``f`` except on a random set ``B``
  of ``round((1 − P) · Vd)`` draft tokens (``g`` permutes ``f``'s successors of ``B`` among
  themselves, so it differs from ``f`` on each of them): ``markov_w2[j] = β · markov_w1[g⁻¹(j)]``.
  Its base logits (``lm_head``) and its layers add only small noise.
* **Acceptance.** A step from anchor ``a`` accepts draft ``k`` exactly when the ``k`` tokens
  ``a, f(a), …`` before it are all outside ``B``; with each token outside ``B`` independently with
  probability ``P``, the mean number of accepted drafts per greedy step is
  ``E[accepted] = Σ_{k=1..γ} P^k`` (``expected_accepted``). The target's distribution puts almost
  all its mass on ``f(s)`` and the draft's on ``g(s)``, so sampling at temperature 1 accepts
  about as often.
* **Confidence.** ``informative``: one dimension ``u`` of ``markov_w1`` is ``+1`` for tokens outside
  ``B`` (and ``−1`` for ``B`` and the tokens outside the draft vocabulary); ``markov_w2``'s column
  ``u`` is zero (the Markov logits do not change) and the confidence head reads only that
  dimension: ``σ(4 · w1[prev, u])``, about 0.98 where the draft will be accepted and 0.02 where
  it will be rejected. ``random``: the head's weights are random (no information).
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import Callable

import torch

from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig

# The shapes of each preset. ``tiny`` is the byte-level toy pair every CPU test uses (``make-tiny``).
PRESETS = {
    "muse-spark-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=131072,
                          draft_layers=5, draft_ffn=14336, draft_vocab=32768, rank=256, gamma=7,
                          aux=(1, 8, 15, 22, 29), max_positions=8192, rope_theta=500000.0),
    "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=259, draft_layers=2,
                 draft_ffn=80, draft_vocab=131, rank=32, gamma=5, aux=(0, 2), max_positions=1024,
                 rope_theta=10000.0),
}
BOS, EOS, MASK = 256, 257, 258  # after the 256 byte tokens, in every preset
SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>")
CONFIDENCE = ("informative", "random")
SHARD_BYTES = 2 << 30
DRAWS = 16
SHARPEN_VOCAB = 16384  # vocabularies up to this size get their target rows sharpened (sharpen)  # candidate sets of disagreeing tokens (plan_bigrams)

# The logit scales of the construction: the target's greedy token leads by TARGET_LOGIT over
# noise of unit spread; the draft's Markov logit for g(prev) is MARKOV_LOGIT with noise of spread
# MARKOV_LOGIT / sqrt(rank) (the other rows' overlap) and base-logit noise of spread DRAFT_NOISE.
TARGET_LOGIT, MARKOV_LOGIT, DRAFT_NOISE, CONFIDENCE_GAIN = 24.0, 16.0, 0.4, 4.0


class PairError(ValueError):
    """A pair that cannot be made as asked (a bad preset, rate or output folder)."""


def expected_accepted(p: float, gamma: int) -> float:
    """Mean accepted drafts per greedy step when each drafted token agrees independently with
    probability ``p``: ``Σ_{k=1..γ} p^k``."""
    return sum(p**k for k in range(1, gamma + 1))


def preset_configs(preset: str, *, gamma: int | None = None, markov_rank: int | None = None,
                   head_type: str = "vanilla", confidence: bool = True, dtype: str = "bfloat16") -> tuple[dict, dict]:
    """The ``config.json`` contents of a preset's target and draft."""
    if preset not in PRESETS:
        raise PairError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    common = dict(
        vocab_size=p["vocab"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], rms_norm_eps=1e-6, norm_affine=True,
        norm_zero_centered_gamma=False, use_rope=True, rope_theta=p["rope_theta"],
        max_position_embeddings=p["max_positions"], attn_output_gate=True, residual_dtype="float32",
        torch_dtype=dtype, residual_multiplier=1.0,
        metap={"use_metap": True, "router_has_one_inf_dim": True, "base_width": 32, "metap_mode": "sp"},
        output_soft_cap_temp=30.0, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=[EOS],
        pad_token_id=EOS,
    )
    target = dict(common, architectures=["MuseSpark1xForCausalLM"], intermediate_size=p["ffn"],
                  num_hidden_layers=p["layers"])
    draft = dict(
        common, architectures=["MuseSparkDSparkForCausalLM"], intermediate_size=p["draft_ffn"],
        num_hidden_layers=p["draft_layers"], draft_vocab_size=p["draft_vocab"], target_hidden_size=p["hidden"],
        target_layer_ids=list(p["aux"]), mask_token_id=MASK, block_size=gamma or p["gamma"], sample_from_anchor=True,
        causal=True, markov_rank=markov_rank or p["rank"], markov_head_type=head_type,
        enable_confidence_head=confidence, confidence_head_with_markov=confidence, dspark_draft_topk=None,
    )
    return target, draft


# ---- tokenizer ------------------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte value 0 … 255 (``ByteLevel``'s alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def make_tokenizer(vocab_size: int = 259):
    """A byte-level tokenizer: ids 0 … 255 the bytes, then ``<|bos|>``, ``<|eos|>``, ``<|mask|>``,
    then (for a larger vocabulary) multi-byte tokens: every two-byte string, then three-byte ones,
    in order, up to ``vocab_size``. Text encodes to bytes; every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    vocab = {ch: i for i, ch in enumerate(chars)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    n = vocab_size - len(vocab)
    if n < 0:
        raise PairError(f"a vocabulary of {vocab_size} cannot hold the 256 bytes and {len(SPECIALS)} special tokens")
    width = 2
    while n > 0:
        for idx in range(min(n, 256**width)):
            digits = [(idx // 256**k) % 256 for k in reversed(range(width))]
            vocab["".join(chars[d] for d in digits)] = len(vocab)
        n -= min(n, 256**width)
        width += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write_tokenizer_config(folder: str | Path) -> None:
    """``folder/tokenizer_config.json`` for ``make_tokenizer``'s tokenizer: its special tokens and a chat
    template (Jinja, rendered as ``transformers`` renders it): ``<|bos|>``, then ``role: content`` and a
    newline per message, then ``assistant: `` when a reply is to follow."""
    template = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
              "mask_token": SPECIALS[2], "add_bos_token": False, "chat_template": template}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- the bigram plan --------------------------------------------------------------------------
def plan_bigrams(vocab: int, draft_vocab: int, acceptance: float, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The target's successor function ``f`` (all tokens → draft tokens, one cycle on the draft
    vocabulary; two, printable and other bytes, for the byte-level toy), the draft's ``g`` (a
    bijection of the draft vocabulary, equal to ``f`` outside ``bad``) and the draft vocabulary
    itself (sorted target ids, no special tokens). CPU tensors."""
    if vocab <= 259:  # the byte-level toy: the printable bytes and others, each group a cycle of its own,
        # so text made of printable bytes stays printable (readable demos)
        printable = torch.arange(32, 127)
        others = torch.tensor([b for b in range(256) if not 32 <= b < 127])
        extra = others[torch.randperm(len(others), generator=g)[: draft_vocab - len(printable)]]
        draft_ids = torch.sort(torch.cat([printable, extra])).values
        cycles = [printable, extra]
    else:
        ordinary = torch.tensor([t for t in range(vocab) if t not in (BOS, EOS, MASK)])
        draft_ids = torch.sort(ordinary[torch.randperm(len(ordinary), generator=g)[:draft_vocab]]).values
        cycles = [draft_ids]
    succ = torch.randint(0, draft_vocab, (vocab,), generator=g)
    f = draft_ids[succ]  # tokens outside the draft vocabulary: a random draft token
    for cycle in cycles:
        order = cycle[torch.randperm(len(cycle), generator=g)]
        f[order] = torch.roll(order, -1)  # a cycle through these draft tokens
    order = draft_ids[torch.randperm(draft_vocab, generator=g)]
    m = round((1.0 - acceptance) * draft_vocab)
    m = max(m, 2) if m else 0  # (one token alone cannot be given another's successor)
    gamma_sim = 7
    best = None
    # A fixed set on one cycle is a single draw of the independent model: of DRAWS sets, keep the one
    # whose simulated greedy walk (walk_mean_accepted) lands nearest Σ P^k, so a small vocabulary
    # gives the rate asked for too.
    for _ in range(DRAWS if 0 < m < draft_vocab else 1):
        bad = order[torch.randperm(draft_vocab, generator=g)[:m]]
        is_bad = torch.ones(vocab, dtype=torch.bool)  # tokens outside the draft vocabulary count as bad
        is_bad[draft_ids] = False
        is_bad[bad] = True
        starts = draft_ids[torch.randint(0, draft_vocab, (64,), generator=g)].tolist()
        err = abs(walk_mean_accepted(f, is_bad, gamma_sim, starts) - expected_accepted(1 - m / draft_vocab, gamma_sim))
        if best is None or err < best[0]:
            best = (err, bad, is_bad)
    _, bad, is_bad = best
    gmap = f.clone()
    if m:
        gmap[bad] = f[torch.roll(bad, -1)]  # (f is one-to-one on the draft vocabulary: g(b) ≠ f(b))
    return {"draft_ids": draft_ids, "f": f, "g": gmap, "bad": is_bad}


def walk_mean_accepted(f: torch.Tensor, bad: torch.Tensor, gamma: int, starts: list[int], steps: int = 64) -> float:
    """Mean accepted drafts per step of greedy generation from each start token, on the plan: a
    step from anchor ``a`` accepts while the tokens ``a, f(a), …`` are good (at most γ) and the
    next anchor is the target's token after the last one tested."""
    f_, bad_ = f.tolist(), bad.tolist()
    total = n = 0
    for a in starts:
        for _ in range(steps):
            j = 0
            while j < gamma and not bad_[a]:
                a, j = f_[a], j + 1
            a = f_[a]  # the bonus token: the next anchor
            total, n = total + j, n + 1
    return total / max(n, 1)


# ---- writing ------------------------------------------------------------------------------------
class ShardWriter:
    """Writes tensors into ``model-0000i-of-0000N.safetensors`` shards of about ``shard_bytes`` and
    the index. Each tensor is moved to the host and converted as it is added; a shard is written
    and dropped once full, so the host holds one shard at a time."""

    def __init__(self, out: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES):
        self.out, self.dtype, self.shard_bytes = out, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, t: torch.Tensor, keep_dtype: bool = False) -> None:
        if t.is_floating_point() and not keep_dtype:
            t = t.to(self.dtype)
        t = t.detach().to("cpu").contiguous()
        self.pending[name] = t
        self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out / f".shard-{len(self.shards)}.safetensors"
        save_file(self.pending, str(path))
        self.shards.append((path, list(self.pending)))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """Name the shards ``model-0000i-of-0000N.safetensors`` and write the index; a checkpoint that
        fits in one shard is one ``model.safetensors`` without an index (as Hugging Face saves them)."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            self.shards[0][0].rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _normal(shape, std: float, g: torch.Generator, device) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device) * std


def _layer(w: ShardWriter, prefix: str, cfg: dict, g: torch.Generator, device, gate: float) -> None:
    """One decoder layer: weights of unit gain per row, residual gates of size ``gate``."""
    d, h, kv, dh, f = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                       cfg["intermediate_size"])
    s = 0.8 / math.sqrt(d)
    attn = f"{prefix}.self_attn"
    w.add(f"{attn}.q_proj.weight", _normal((h * dh, d), s, g, device))
    w.add(f"{attn}.k_proj.weight", _normal((kv * dh, d), s, g, device))
    w.add(f"{attn}.v_proj.weight", _normal((kv * dh, d), s, g, device))
    if cfg["attn_output_gate"]:
        w.add(f"{attn}.o_gate_proj.weight", _normal((h * dh, d), s, g, device))
    w.add(f"{attn}.o_proj.weight", _normal((d, h * dh), 0.8 / math.sqrt(h * dh), g, device))
    for norm in (f"{attn}.pre_qkv_proj_norm", f"{prefix}.post_attn_norm", f"{prefix}.pre_ffn_norm",
                 f"{prefix}.post_ffn_norm"):
        w.add(f"{norm}.weight", 1 + _normal((d,), 0.1, g, device))
    w.add(f"{prefix}.feed_forward.gate_proj.weight", _normal((f, d), s, g, device))
    w.add(f"{prefix}.feed_forward.up_proj.weight", _normal((f, d), s, g, device))
    w.add(f"{prefix}.feed_forward.down_proj.weight", _normal((d, f), 0.8 / math.sqrt(f), g, device))
    # The post-norms give each branch unit RMS: the gates set its weight (float32, as checkpoints keep them).
    for gate_name in ("attn_residual_gate", "ffn_residual_gate"):
        w.add(f"{prefix}.{gate_name}", gate * (0.5 + torch.rand(d, generator=g, device=device)), keep_dtype=True)


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=-1, keepdim=True)


def sharpen(lm: torch.Tensor, embed: torch.Tensor, norm_w: torch.Tensor, f: torch.Tensor, mult: float,
            log: Callable[[str], None], iters: int = 200) -> None:
    """Make every token's successor ``f(s)`` lead the target's logits at the final hidden state its
    own embedding gives (``norm(embed[s])``) by half of TARGET_LOGIT: a few perceptron passes over
    the rows that do not yet. A narrow model (the tiny preset) needs it, where the rows' overlaps
    are large; at 4096 wide the construction already has the margin. ``lm`` is changed in place."""
    x = embed.float() * torch.rsqrt(embed.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()
    margin, rate = TARGET_LOGIT / 2, TARGET_LOGIT / (mult * x.pow(2).sum(-1).mean())
    for it in range(iters):
        logits = (x @ lm.T) * mult
        right = logits.gather(1, f[:, None]).squeeze(1)
        logits.scatter_(1, f[:, None], float("-inf"))
        worst, rival = logits.max(1)
        weak = worst > right - margin
        if not weak.any():
            return
        step = x[weak] * rate * 0.25
        lm.index_add_(0, f[weak], step)
        lm.index_add_(0, rival[weak], -step)
    log(f"  target: {int(weak.sum())} tokens' successors still lead by less than {margin} after {iters} passes")


def write_target(out: Path, cfg: dict, plan: dict, g: torch.Generator, device, dtype: torch.dtype,
                 shard_bytes: int, log: Callable[[str], None]) -> None:
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    mult = MuseSpark1xConfig.from_dict(cfg, "target").output_multiplier
    w = ShardWriter(out, dtype, shard_bytes)
    embed = _normal((V, d), 1.0, g, device)
    w.add("model.embed_tokens.weight", embed)
    for i in range(cfg["num_hidden_layers"]):
        _layer(w, f"model.layers.{i}", cfg, g, device, gate=0.02)
        if (i + 1) % 8 == 0:
            log(f"  target: {i + 1}/{cfg['num_hidden_layers']} layers")
    norm_w = 1 + _normal((d,), 0.1, g, device)
    w.add("model.norm.weight", norm_w)
    # Row f(s) points along ê_s: logit ≈ TARGET_LOGIT for the successor, unit noise elsewhere.
    scale = 1.0 / (math.sqrt(d) * mult)
    lm = _normal((V, d), scale, g, device)
    lm.index_add_(0, plan["f"].to(device), _unit_rows(embed.float()) * (TARGET_LOGIT * scale))
    if V <= SHARPEN_VOCAB:
        sharpen(lm, embed, norm_w, plan["f"].to(device), mult, log)
    del embed
    w.add("lm_head.weight", lm)
    del lm
    w.close()


def write_draft(out: Path, cfg: dict, plan: dict, g: torch.Generator, device, dtype: torch.dtype,
                confidence: str, shard_bytes: int) -> None:
    d, V, Vd, r = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"], cfg["markov_rank"]
    mult = MuseSpark1xConfig.from_dict(cfg, "draft").output_multiplier
    w = ShardWriter(out, dtype, shard_bytes)
    w.add("fc.weight", _normal((d, cfg["target_hidden_size"] * len(cfg["target_layer_ids"])), 0.1 / math.sqrt(d), g,
                               device))
    w.add("hidden_norm.weight", 1 + _normal((d,), 0.1, g, device))
    for i in range(cfg["num_hidden_layers"]):
        _layer(w, f"layers.{i}", cfg, g, device, gate=0.5)
    w.add("norm.weight", 1 + _normal((d,), 0.1, g, device))
    w.add("lm_head.weight", _normal((Vd, d), DRAFT_NOISE / (math.sqrt(d) * mult), g, device))
    # Markov head: W1 rows of unit norm; W2[j] = β · W1[g⁻¹(j)] (g is one-to-one on the draft vocabulary).
    w1 = _unit_rows(_normal((V, r), 1.0, g, device))
    u = r - 1  # the confidence dimension
    informative = confidence == "informative"
    if informative:
        w1[:, u] = 0
        w1 = _unit_rows(w1)
        w1[:, u] = torch.where(plan["bad"].to(device), -1.0, 1.0)
    draft_ids = plan["draft_ids"].to(device)
    inverse = torch.empty(V, dtype=torch.int64, device=device)
    inverse[plan["g"].to(device)[draft_ids]] = draft_ids  # g⁻¹ on the draft vocabulary, indexed by target id
    w2 = w1[inverse[draft_ids]] * MARKOV_LOGIT
    if informative:
        w2[:, u] = 0
    w.add("markov_head.markov_w1.weight", w1)
    w.add("markov_head.markov_w2.weight", w2)
    head = cfg["markov_head_type"]
    if head == "gated":  # gate ≈ σ(3) on every dimension
        w.add("markov_head.gate_proj.weight", _normal((r, d + r), 0.05 / math.sqrt(d + r), g, device))
        w.add("markov_head.gate_proj.bias", torch.full((r,), 3.0, device=device))
    elif head == "rnn":  # output ≈ tanh(W1[prev]): the last block of rows reads W1[prev] through the identity
        joint = _normal((3 * r, 2 * r + d), 0.01 / math.sqrt(2 * r + d), g, device)
        joint[2 * r:, r:2 * r] += torch.eye(r, device=device)
        w.add("markov_head.joint_proj.weight", joint)
        w.add("markov_head.joint_proj.bias", torch.zeros(3 * r, device=device))
    if cfg["enable_confidence_head"]:
        width = d + (r if cfg["confidence_head_with_markov"] else 0)
        if informative:
            if not cfg["confidence_head_with_markov"]:
                raise PairError("informative confidence reads the Markov features: the draft needs "
                                "confidence_head_with_markov")
            proj = torch.zeros(1, width, device=device)
            proj[0, d + u] = CONFIDENCE_GAIN
        else:
            proj = _normal((1, width), 1.0 / math.sqrt(width), g, device)
        w.add("confidence_head.proj.weight", proj)
        w.add("confidence_head.proj.bias", torch.zeros(1, device=device))
    w.add("d2t", draft_ids - torch.arange(Vd, device=device))
    w.add("t2d", torch.zeros(V, dtype=torch.bool, device=device).index_fill_(0, draft_ids, True))  # (not loaded)
    w.close()


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PairError("--device cuda: no CUDA device is available here (use --device cpu or auto)")
    return torch.device(device)


def make_pair(out: str | Path, preset: str = "tiny", *, acceptance: float = 0.8, confidence: str = "informative",
              seed: int = 0, device: str | None = None, gamma: int | None = None, head_type: str = "vanilla",
              dtype: str = "bfloat16", shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
              log: Callable[[str], None] = lambda s: None) -> dict:
    """Write ``out/target``, ``out/draft`` and ``out/pair.json``; → the summary (``pair.json``'s
    contents). Raises ``PairError`` for a bad preset, rate, confidence or an output that exists."""
    if preset not in PRESETS:
        raise PairError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    if not (isinstance(acceptance, (int, float)) and 0.0 <= acceptance <= 1.0):
        raise PairError(f"acceptance must be a rate in [0, 1], got {acceptance!r}")
    if confidence not in CONFIDENCE:
        raise PairError(f"unknown confidence {confidence!r}: expected one of {', '.join(CONFIDENCE)}")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise PairError(f"unknown dtype {dtype!r}: expected bfloat16, float16 or float32")
    out = Path(out)
    for sub in ("target", "draft"):
        if (out / sub).exists():
            if not overwrite:
                raise PairError(f"{out / sub} exists: pass overwrite (--overwrite) or choose another folder")
            # Only this writer's files are replaced (nothing else in the folder is touched); old weight
            # files go first, so no shard of another pair is left beside the new index.
            for old in (out / sub).glob("model*.safetensors*"):
                if old.is_file():
                    old.unlink()
    dev = pick_device(device)
    tcfg, dcfg = preset_configs(preset, gamma=gamma, head_type=head_type, dtype=dtype)
    # the configs are checked as the loader checks them, before any weight is made
    t, dr = MuseSpark1xConfig.from_dict(tcfg, "target"), MuseSparkDSparkConfig.from_dict(dcfg, "draft")
    dr.validate_against(t)
    g_cpu = torch.Generator().manual_seed(seed)
    plan = plan_bigrams(tcfg["vocab_size"], dcfg["draft_vocab_size"], float(acceptance), g_cpu)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    log(f"making a {preset} pair on {dev} (acceptance {acceptance}, {confidence} confidence, seed {seed})")
    with torch.no_grad():
        write_target(out / "target", tcfg, plan, g, dev, torch_dtype, shard_bytes, log)
        log("  target written; writing the draft")
        write_draft(out / "draft", dcfg, plan, g, dev, torch_dtype, confidence, shard_bytes)
    tok = make_tokenizer(tcfg["vocab_size"])
    for sub, cfg in (("target", tcfg), ("draft", dcfg)):
        (out / sub / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok.save(str(out / sub / "tokenizer.json"))
        write_tokenizer_config(out / sub)
    gamma_ = dcfg["block_size"]
    draft_bad = int(plan["bad"][plan["draft_ids"]].sum())
    summary = {
        "preset": preset, "acceptance": float(acceptance), "confidence": confidence, "seed": seed,
        "device": str(dev), "dtype": dtype, "gamma": gamma_, "head_type": head_type,
        "draft_tokens_disagreeing": draft_bad, "draft_vocab": dcfg["draft_vocab_size"],
        "agreement": 1 - draft_bad / dcfg["draft_vocab_size"],
        "expected_accepted_per_step": expected_accepted(1 - draft_bad / dcfg["draft_vocab_size"], gamma_),
        "model": "each drafted token agrees independently with probability P: E[accepted] = sum_{k=1..gamma} P^k",
        "peak_host_memory_gib": round(peak_host_memory_gib(), 2),
    }
    (out / "pair.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def peak_host_memory_gib() -> float:
    """This process's peak resident memory (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def draft_token_ids(pair_dir: str | Path) -> list[int]:
    """The draft vocabulary (target ids) of a pair written by ``make_pair``: the tokens prompts
    should be drawn from to see the pair's acceptance from the first step."""
    from safetensors import safe_open

    d = Path(pair_dir) / "draft"
    index = d / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["d2t"] if index.is_file() else "model.safetensors"
    with safe_open(str(d / shard), "pt") as f:
        d2t = f.get_tensor("d2t")
    return (d2t + torch.arange(len(d2t))).tolist()


def random_prompts(token_ids: list[int], n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens drawn from ``token_ids`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(token_ids)
    return [ids[torch.randint(0, len(ids), (length,), generator=g)].tolist() for _ in range(n)]


__all__ = ["PRESETS", "PairError", "expected_accepted", "make_pair", "make_tokenizer", "preset_configs",
           "draft_token_ids", "random_prompts", "plan_bigrams", "peak_host_memory_gib"]
