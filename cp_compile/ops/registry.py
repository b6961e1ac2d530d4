"""What the compiler passes need to know about each CP schedule, registered next to it.

A schedule is a pair of whole ops (forward, backward) that Stage 1 inserts and
Stage 2 replaces by tracing the schedule's Python functions. Each schedule
module registers here:

- how a whole op's arguments map to the function that runs it step by step
  (``Traceable``), for the expansion;
- which forward ops' outputs must be saved for backward (never recomputed);
- which per-step compute ops communication should overlap with, and the short
  names the schedule listing in ``explain`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch._ops import OpOverload


@dataclass(frozen=True)
class Traceable:
    """A whole-op call as a function of its tensor arguments."""

    direction: str  # "forward" | "backward"
    world_size: int
    fn: Callable[..., Any]  # takes ``tensors`` positionally; returns the op's outputs
    tensors: list  # the op's tensor arguments in ``fn``'s order (fx nodes, in a graph)


EXPANSIONS: dict[OpOverload, Callable[[tuple], Traceable]] = {}
FORWARD_OPS: set[OpOverload] = set()
COMPUTE_OPS: set[OpOverload] = set()
LISTING_NAMES: dict[OpOverload, str] = {}


def register_schedule(
    forward_op: OpOverload, expand_forward: Callable[[tuple], Traceable],
    backward_op: OpOverload, expand_backward: Callable[[tuple], Traceable],
    compute_ops: dict[OpOverload, str],
) -> None:
    """Register a schedule's whole ops, their expansions and its step compute ops (with listing names)."""
    EXPANSIONS[forward_op] = expand_forward
    EXPANSIONS[backward_op] = expand_backward
    FORWARD_OPS.add(forward_op)
    register_compute_ops(compute_ops)


def register_compute_ops(compute_ops: dict[OpOverload, str]) -> None:
    """Step compute ops (with listing names) of a registered schedule, e.g. another inner attention's."""
    COMPUTE_OPS.update(compute_ops)
    LISTING_NAMES.update(compute_ops)
