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
it resumes later with the same bits, so with the same tokens.
"""

from __future__ import annotations

import torch

from muse_spark.engine_format import EngineError


class BlockPoolError(EngineError):
    """A paged cache that cannot work: a bad block size or a pool too small for one request."""


class BlockTables:
    """The free blocks of a pool and each slot's blocks; the tables themselves as a device tensor
    ``table`` [slots, blocks per slot] (int64; 0: none) that the engine indexes by slot."""

    def __init__(self, blocks: int, block_size: int, slots: int, max_seq: int, device):
        if not (isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0):
            raise BlockPoolError(f"KV block size must be a power of two, got {block_size!r}")
        per_slot = -(-max_seq // block_size)
        if blocks - 1 < per_slot:
            raise BlockPoolError(
                f"a KV pool of {blocks} blocks of {block_size} tokens ({blocks - 1} usable: block 0 is kept "
                f"empty) cannot hold one request of max_seq {max_seq} tokens ({per_slot} blocks): give it at least "
                f"{(per_slot + 1) * block_size} tokens")
        self.blocks, self.block_size, self.max_seq = blocks, block_size, max_seq
        self.free = list(range(blocks - 1, 0, -1))  # (pop() hands out the lowest id first)
        self.owned: list[list[int]] = [[] for _ in range(slots)]
        self.table = torch.zeros(slots, per_slot, dtype=torch.int64, device=device)

    @property
    def free_tokens(self) -> int:
        return len(self.free) * self.block_size

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
        if n > len(self.free):
            return False
        if n:
            new = [self.free.pop() for _ in range(n)]
            have = len(self.owned[slot])
            self.owned[slot].extend(new)
            self.table[slot, have : have + n] = torch.tensor(new, dtype=torch.int64)
        return True

    def release(self, slot: int) -> None:
        """Return ``slot``'s blocks to the pool and clear its table row."""
        if self.owned[slot]:
            self.free.extend(reversed(self.owned[slot]))
            self.owned[slot] = []
            self.table[slot].zero_()

    def positions(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of ``slot``'s positions ``[start, end)``: an index into every pool."""
        pos = torch.arange(start, end, device=self.table.device)
        return self.table[slot, pos // self.block_size], pos % self.block_size

    def check(self) -> None:
        """Every block is free or held by one slot, exactly once (a test's leak check)."""
        held = [b for row in self.owned for b in row]
        every = sorted(held + self.free)
        if every != list(range(1, self.blocks)):
            raise AssertionError(f"KV block accounting broken: {len(held)} held + {len(self.free)} free of "
                                 f"{self.blocks - 1}, duplicates or losses present")
