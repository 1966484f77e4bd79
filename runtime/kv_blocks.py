"""Paged KV caches: the target's K/V and the draft's context K/V as pools of fixed-size blocks, and
each request slot's block table.

A slot's table row lists the blocks that hold its positions, ``P`` (``block_size``) positions a block,
in order; a block id indexes every cache's pool at once (the target's layers and the draft's), so one
table serves them all. Block 0 is no request's: a table entry past a slot's own blocks names it, so a
write past a request's end (a padded prefill chunk) lands there and no query ever sees it.

Memory is a pool, not a reservation of ``max_batch × max_seq`` positions: a slot holds blocks for the
positions it has reached (``reserve``), and gives them back when its request ends (``release``). The
Generator admits a request while the pool has blocks for its prompt and its first step, grows each
running request's blocks before a step, and when the pool runs short preempts the newest request
(``runtime/generator.py``): its K/V are copied out (``EagerEngine.swap_out``), its blocks freed, and
it resumes later with the same bits, so with the same tokens. The copies live in host memory up to the
engine's swap space (``swap_space`` GiB, ``SWAP_SPACE_GIB`` by default, as vLLM's ``--swap-space``); a
request whose copy would pass it is preempted by recompute instead: its blocks freed, its prompt and its
emitted tokens prefilled again when it resumes.

Full prompt blocks are shared by reference. Once a request's prefill has written a block that its
prompt fills, the block is registered under a chained hash of every prompt token up to its end
(``prefix_cache.chunk_keys``); a request admitted later whose prompt starts with registered blocks maps
them into its table (a reference each) and prefills after them. A block nobody references keeps its
contents while the pool has other free blocks, and is reused least recently used first (a prefix's
deeper blocks before the ones in front of them) when it has none.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from muse_spark.engine_format import EngineError, kv_pool_blocks


# Host memory (GiB) for the K/V of requests preempted by swapping, by default (``swap_space_bytes``).
SWAP_SPACE_GIB = 4.0


def swap_space_bytes(gib) -> int:
    """The swap space of ``gib`` GiB in bytes, checked: a finite number >= 0 (0: every preemption of a
    running request recomputes its K/V)."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib < 0:
        raise EngineError(f"swap space must be a finite number of GiB >= 0, got {gib!r}")
    return int(gib * 2**30)


class BlockPoolError(EngineError):
    """A paged cache that cannot work: a bad block size or a pool too small for one request."""


class BlockTables:
    """The free blocks of a pool and each slot's blocks; the tables themselves as a device tensor
    ``table`` [slots, blocks per slot] (int64; 0: none) that the engine indexes by slot."""

    def __init__(self, blocks: int, block_size: int, slots: int, max_seq: int, device):
        kv_pool_blocks((blocks - 1) * block_size, block_size, max_seq, BlockPoolError)  # (checked: a clear error)
        per_slot = -(-max_seq // block_size)
        self.blocks, self.block_size, self.max_seq = blocks, block_size, max_seq
        self.free = list(range(blocks - 1, 0, -1))  # (pop() hands out the lowest id first)
        self.owned: list[list[int]] = [[] for _ in range(slots)]
        self.table = torch.zeros(slots, per_slot, dtype=torch.int64, device=device)
        self.refs = [0] * blocks  # the slots holding each block
        self.cached: dict[bytes, int] = {}  # a registered prompt block's key → its block
        self.key_of: dict[int, bytes] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()  # registered, no slot holds it: reused oldest first

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int, slots: int, max_seq: int, device) -> "BlockTables":
        """The tables of a pool of ``tokens`` positions (``engine_format.kv_pool_blocks``)."""
        return cls(kv_pool_blocks(tokens, block_size, max_seq, BlockPoolError), block_size, slots, max_seq, device)

    @property
    def free_tokens(self) -> int:
        return (len(self.free) + len(self.unused)) * self.block_size

    def _take(self) -> int:
        """A block for a slot: a free one, else the least recently used registered one nobody holds."""
        if self.free:
            return self.free.pop()
        b, _ = self.unused.popitem(last=False)
        del self.cached[self.key_of.pop(b)]
        return b

    def _hold(self, slot: int, blocks: list[int]) -> None:
        have = len(self.owned[slot])
        for b in blocks:
            self.refs[b] += 1
        self.owned[slot].extend(blocks)
        ids = torch.tensor(blocks, dtype=torch.int64)
        if self.table.is_cuda:  # (pinned and asynchronous: a pageable copy would wait for the steps in flight)
            ids = ids.pin_memory()
        self.table[slot, have : have + len(blocks)].copy_(ids, non_blocking=True)

    def cached_run(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a prompt's block keys, in order) are registered, from the first on."""
        n = 0
        while n < len(keys) and keys[n] in self.cached:
            n += 1
        return n

    def attach(self, slot: int, keys: list[bytes]) -> None:
        """Map the registered blocks of ``keys`` (all registered: ``cached_run``) into ``slot``'s table from
        its first position on (a slot holding nothing yet)."""
        assert not self.owned[slot], "attach: the slot already holds blocks"
        blocks = [self.cached[k] for k in keys]
        for b in blocks:
            self.unused.pop(b, None)
        self._hold(slot, blocks)

    def register(self, slot: int, keys: list[bytes]) -> None:
        """Register ``slot``'s first ``len(keys)`` blocks (written, filled by the prompt) under ``keys``; a
        key or a block registered already stays as it is."""
        for key, b in zip(keys, self.owned[slot]):
            if key not in self.cached and b not in self.key_of:
                self.cached[key], self.key_of[b] = b, key

    @property
    def capacity_tokens(self) -> int:
        """Positions the pool holds in all (block 0 aside)."""
        return (self.blocks - 1) * self.block_size

    def needed(self, slot: int, end: int) -> int:
        """Blocks ``slot`` still needs to hold positions ``[0, end)``."""
        return max(0, -(-min(end, self.max_seq) // self.block_size) - len(self.owned[slot]))

    def reserve(self, slot: int, end: int) -> bool:
        """Give ``slot`` blocks for positions ``[0, end)`` (clamped to ``max_seq``); → False, and
        nothing taken, when the pool has too few free."""
        n = self.needed(slot, end)
        if n > len(self.free) + len(self.unused):
            return False
        if n:
            self._hold(slot, [self._take() for _ in range(n)])
        return True

    def release(self, slot: int) -> None:
        """Drop ``slot``'s references to its blocks and clear its table row: a block nobody holds goes back
        to the pool (a registered one keeps its contents until the pool needs it)."""
        if self.owned[slot]:
            for b in reversed(self.owned[slot]):  # (deeper blocks first: reused before the ones in front)
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    if b in self.key_of:
                        self.unused[b] = None
                    else:
                        self.free.append(b)
            self.owned[slot] = []
            self.table[slot].zero_()

    def positions(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of ``slot``'s positions ``[start, end)``: an index into every pool."""
        pos = torch.arange(start, end, device=self.table.device)
        return self.table[slot, pos // self.block_size], pos % self.block_size

    def check(self) -> None:
        """Every block is held (its count of references right), free or unused-but-registered, exactly one
        of them, and no block is lost (a test's leak check)."""
        counts = [0] * self.blocks
        for row in self.owned:
            for b in row:
                counts[b] += 1
        held = [b for b in range(1, self.blocks) if counts[b]]
        every = sorted(held + self.free + list(self.unused))
        if every != list(range(1, self.blocks)) or counts != self.refs:
            raise AssertionError(f"KV block accounting broken: {len(held)} held + {len(self.free)} free + "
                                 f"{len(self.unused)} unused of {self.blocks - 1}, or references miscounted")
        if any(self.cached[k] != b for b, k in self.key_of.items()) or len(self.cached) != len(self.key_of):
            raise AssertionError("KV block registry broken: keys and blocks disagree")
