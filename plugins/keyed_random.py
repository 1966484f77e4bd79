"""Counter-based randomness keyed by (request seed, position, salt, index).

Speculative decoding is lossless only if every random draw is independent of
batch composition, and the fused GPU kernels must draw *the same* numbers as
this reference so that sampled tokens are identical. A stateful generator can
do neither, so every draw is a pure function of its key: a 32-bit integer
hash (murmur3's finalizer, chained over the key words) turned into a uniform
in (0, 1) with 23 bits, exactly representable in fp32.

The same arithmetic is written in Triton (uint32 wrap-around) by the GPU
kernels; here it runs in int64 and is masked to 32 bits after every multiply
(the low 32 bits of a wrapped 64-bit product are the uint32 product).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9

# Salts: each use of randomness has its own stream.
SALT_DRAFT = 0x0D5A  # the draft's Gumbel noise (Markov loop)
SALT_ACCEPT = 0x0ACC  # the verifier's acceptance uniforms
SALT_TARGET = 0x7A26  # target sampling: bonus / residual / plain decoding


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding uint32 values."""
    h = h & MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    h = h ^ (h >> 16)
    return h


def key_hash(seed: torch.Tensor, position: torch.Tensor, salt: int) -> torch.Tensor:
    """Per-row key: seed [*], position [*] (int64) → uint32 in int64 [*]."""
    seed = seed.to(torch.int64)
    lo = seed & MASK32
    hi = (seed >> 32) & MASK32
    h = fmix32(lo ^ (salt * GOLDEN & MASK32))
    h = fmix32(h ^ hi)
    h = fmix32(h ^ (position.to(torch.int64) & MASK32))
    return h


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """uint32 hash values (in int64) → fp32 uniforms strictly inside (0, 1)."""
    # 23 bits: (k + 0.5) for k < 2^23 is exact in fp32, so u lies strictly inside
    # (0, 1). (With 24 bits, k = 2^24 − 1 rounds to u = 1.0 and the Gumbel noise to +inf.)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform_from_key(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """key [*, 1] (uint32 in int64), index [N] → fp32 uniforms in (0, 1) [*, N]."""
    return uniform_from_hash(fmix32(key ^ ((index.to(torch.int64) * GOLDEN) & MASK32)))


def keyed_uniform(seed: torch.Tensor, position: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """[*, n] uniforms in (0, 1), a pure function of (seed, position, salt, index)."""
    key = key_hash(seed, position, salt).unsqueeze(-1)
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    return uniform_from_key(key, idx)


def keyed_gumbel(seed: torch.Tensor, position: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """[*, n] standard Gumbel noise keyed like ``keyed_uniform``."""
    u = keyed_uniform(seed, position, salt, n)
    return -torch.log(-torch.log(u))
