"""The process groups a tensor-parallel rank set uses beside the default one (``runtime/tensor_parallel.py``).

The default group (name "0") belongs to the compiled packages of an aoti engine built for ranks: their
traced collectives resolve it by name. Collectives issued from Python on that same group interleave with
the packages' and mismatch (seen with gloo: a broadcast between two package calls deadlocks), so Python
keeps to groups of its own: "control" (gloo, CPU objects: the leader's broadcast calls) and "model" (the
default backend: the eager model's all-reduces and gathers).
"""

from __future__ import annotations

import torch.distributed as dist

_GROUPS: dict = {}


def init_groups() -> None:
    """Create the rank set's own groups; every rank calls it once, right after ``init_process_group``."""
    _GROUPS["control"] = dist.new_group(backend="gloo")
    _GROUPS["model"] = dist.new_group()


def control_group():
    """The group the leader broadcasts its calls on (None where ``init_groups`` was not run: the default)."""
    return _GROUPS.get("control")


def model_group():
    """The group the eager model's collectives run on (the default group where ``init_groups`` was not run)."""
    g = _GROUPS.get("model")
    return dist.group.WORLD if g is None else g
