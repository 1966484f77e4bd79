"""Build arguments checked against the checkpoint pair before anything is built (shared by every
backend's build and by ``muse-spark export-onnx``)."""

from __future__ import annotations


def check_max_batch(max_batch: int) -> None:
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")


def check_max_seq(target, draft, max_seq: int) -> None:
    """--max-seq against the pair: room for a step's γ + 1 tokens after an anchor, within the target's positions."""
    gamma = draft.cfg.block_size
    if max_seq < gamma + 2:
        raise ValueError(f"--max-seq must be at least γ+2 = {gamma + 2}, got {max_seq}")
    if max_seq > target.cfg.max_position_embeddings:
        raise ValueError(
            f"--max-seq {max_seq} exceeds the target's max_position_embeddings {target.cfg.max_position_embeddings}"
        )
