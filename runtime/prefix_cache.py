"""Prefix caching: the K/V of prompt prefixes kept and reused, so a shared system prompt is prefilled once.

A block is one prefill chunk (``engine.prefill_chunk`` tokens) at a chunk boundary: after a request's
prefill completes a full chunk, the chunk's target K/V (every layer) and the draft's context K/V at its
positions are copied out of the request's cache slot and stored under the hash of every prompt token
up to the chunk's end (so a block is found only behind the same prefix, at the same positions). A new
request whose prompt starts with stored blocks gets them copied into its slot and prefills from the
first chunk after them — at least its last token is always prefilled, for its first generated token.

Exact: a stored block holds the values the same chunk of the same prefix computes (prefill runs in
the same chunks), so a request gets the tokens it gets without the cache, greedy or seeded. The copies
are in place, so an engine's captured CUDA graphs keep their cache addresses. Blocks are evicted least
recently used beyond ``capacity_bytes`` (a prefix's first block counting as its most recent, so deep
blocks go before the blocks in front of them); a request never points at a stored block (its slot holds a
copy), so eviction cannot corrupt a running request.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def chunk_keys(prompt: list[int], chunk: int, blocks: int) -> list[bytes]:
    """The keys of a prompt's first ``blocks`` chunks of ``chunk`` tokens, chained: chunk j's key
    hashes chunk j−1's key and its own tokens (so it names every token up to its end)."""
    keys, key = [], b""
    for j in range(blocks):
        tokens = np.asarray(prompt[j * chunk : (j + 1) * chunk], dtype=np.int64).tobytes()
        key = hashlib.sha256(key + tokens).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """The store's bookkeeping: which blocks are kept (chained keys), their bytes, least-recently-used
    order. The blocks themselves live with the engine (``EagerEngine.store_block`` / ``load_block`` /
    ``drop_block``), so a tensor-parallel leader broadcasts each of those calls and every rank keeps its
    own slice of the same blocks."""

    def __init__(self, engine, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"prefix cache capacity must be ≥ 0 bytes, got {capacity_bytes}")
        self.engine, self.block, self.capacity = engine, engine.prefill_chunk, int(capacity_bytes)
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # key → bytes (this rank's)
        self.bytes = 0
        self.lookups = self.hits = self.reused_tokens = self.evicted = 0

    def _keys(self, prompt: list[int], blocks: int) -> list[bytes]:
        return chunk_keys(prompt, self.block, blocks)

    def _key(self, prompt: list[int], blocks: int) -> bytes:
        return self._keys(prompt, blocks)[-1]

    def lookup(self, prompt: list[int]) -> int:
        """The number of leading blocks of ``prompt`` stored (leaving at least one token to prefill)."""
        self.lookups += 1
        k = 0
        for key in self._keys(prompt, (len(prompt) - 1) // self.block):
            if key not in self.entries:  # (a block is usable behind the ones before it)
                break
            k += 1
        if k:
            self.hits += 1
            self.reused_tokens += k * self.block
        return k

    def restore(self, prompt: list[int], blocks: int, slot: int) -> None:
        """Copy the first ``blocks`` stored blocks of ``prompt`` into cache slot ``slot`` (in place)."""
        for j, key in enumerate(self._keys(prompt, blocks)):
            self.engine.load_block(key, slot, j * self.block, (j + 1) * self.block)
        self._touch(prompt, blocks)

    def _touch(self, prompt: list[int], blocks: int) -> None:
        """Mark a prefix's blocks used, its first the most recently: a deep block is evicted before the
        blocks in front of it (without which it is of no use)."""
        for key in reversed(self._keys(prompt, blocks)):
            if key in self.entries:
                self.entries.move_to_end(key)

    def insert(self, prompt: list[int], block: int, slot: int) -> None:
        """Store block ``block`` (positions ``[block·C, (block+1)·C)``) of ``prompt`` from slot ``slot``,
        where the slot's prefill has just written it."""
        key = self._key(prompt, block + 1)
        if key in self.entries:
            self._touch(prompt, block + 1)
            return
        size = self.engine.block_bytes(self.block)
        if size > self.capacity:
            return
        self.engine.store_block(key, slot, block * self.block, (block + 1) * self.block)
        self.entries[key] = size
        self.bytes += size
        self._touch(prompt, block + 1)
        while self.bytes > self.capacity:
            old, freed = self.entries.popitem(last=False)
            self.engine.drop_block(old)
            self.bytes -= freed
            self.evicted += 1

    def stats(self) -> dict:
        return {"blocks": len(self.entries), "bytes": self.bytes, "capacity_bytes": self.capacity,
                "lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "evicted_blocks": self.evicted}
