"""What the compiler passes need to know about each CP schedule, registered with it.

A schedule is a pair of whole ops (forward, backward) that Stage 1 inserts and
Stage 2 replaces by tracing the schedule's Python functions
(``schedules.whole`` defines and registers both). The passes read here:

- how a whole op's arguments map to the function that runs it step by step
  (``Traceable``), for the expansion;
- which forward ops' outputs must be saved for backward (never recomputed);
- which per-step compute ops communication should overlap with (every
  schedule's are ``cp::attend`` / ``cp::attend_backward``; the listing in
  ``explain`` names them with ``kinds.attend.listing_name``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

EXPANSIONS: dict[OpOverload, Callable[[tuple], Traceable]] = {}
FORWARD_OPS: set[OpOverload] = set()
COMPUTE_OPS: set[OpOverload] = {torch.ops.cp.attend.default, torch.ops.cp.attend_backward.default}


@dataclass(frozen=True)
class Traceable:
    """A whole-op call as a function of its graph inputs."""

    direction: str  # "forward" | "backward"
    world_size: int
    fn: Callable[..., Any]  # takes ``inputs`` positionally; returns the op's outputs
    inputs: list  # the op's tensor arguments in ``fn``'s order, then a flex call's mods (fx nodes, in a graph)


def register_schedule(
    forward_op: OpOverload,
    expand_forward: Callable[[tuple], Traceable],
    backward_op: OpOverload,
    expand_backward: Callable[[tuple], Traceable],
) -> None:
    """Register a schedule's whole ops and their expansions."""
    EXPANSIONS[forward_op] = expand_forward
    EXPANSIONS[backward_op] = expand_backward
    FORWARD_OPS.add(forward_op)
