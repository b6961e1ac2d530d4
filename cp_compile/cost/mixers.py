"""Which route a linear recurrence takes under CP, and why: the all-to-all to head groups or state passing.

Per layer and rank, forward plus backward (the backward moves as much again):

- ``heads``: two all-to-alls each way of the scan's per-token inputs and outputs, (C-1)/C of
  ``B * L * (W_in + W_out)`` elements; the compute is the one-process scan's share;
- ``states``: one all-gather of C * F fp32 summaries (``[H, d_k, d_k + d_v]`` a head for the gated delta rule,
  ``[H, P * N + 1]`` for Mamba2), independent of L; extra compute: the gated delta rule's scan carries d_k more
  value columns, and both correct every output by the entering state.

Transfers cost ``latency + bytes / bandwidth`` on the plan's ``Machine``; neither route overlaps its transfers
(the scan needs the all-to-all's result; the correction needs the summaries). State passing is a candidate only
where it moves fewer bytes than the all-to-all (short sequences stay on the all-to-all, which gives each head's
one-process result to the bit). Packed documents have two chunks per document and rank, so state passing's bytes
grow with the number of documents. Every input is the same on every rank, so every rank takes the same route.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import Machine, fmt_bytes

ROUTES = ("heads", "states")


@dataclass(frozen=True)
class ScanShape:
    """One scan call as a rank sees it: the recurrence's kind and sizes (``state_dims``: d_k, d_v for the gated
    delta rule; P, N for Mamba2)."""

    kind: str  # "delta_rule" or "mamba2"
    batch: int
    local_len: int
    world_size: int
    chunks: int  # F: chunks of consecutive positions per rank
    in_width: int  # elements per token of the inputs the all-to-all moves
    out_width: int  # elements per token of the output
    heads: int  # value heads (gated delta rule) or heads (Mamba2)
    state_dims: tuple[int, int]
    itemsize: int

    @classmethod
    def delta_rule(cls, batch, local_len, world_size, chunks, hk, dk, hv, dv, gate, itemsize):
        """A gated delta rule's call: q, k ``[.., hk, dk]``, v ``[.., hv, dv]``, ``gate`` elements of g a token
        (hv, or hv * dk for KDA), beta ``[.., hv]``."""
        width = 2 * hk * dk + hv * dv + gate + hv
        return cls("delta_rule", batch, local_len, world_size, chunks, width, hv * dv, hv, (dk, dv), itemsize)

    @classmethod
    def mamba2(cls, batch, local_len, world_size, chunks, heads, p, groups, n, itemsize):
        """A Mamba2 SSD call: x ``[.., heads, p]``, dt ``[.., heads]``, B, C ``[.., groups, n]`` (a copy per head
        when C does not divide the groups)."""
        moved_groups = groups if groups % world_size == 0 else heads
        width = heads * (p + 1) + 2 * moved_groups * n
        return cls("mamba2", batch, local_len, world_size, chunks, width, heads * p, heads, (p, n), itemsize)


@dataclass(frozen=True)
class RouteEstimate:
    route: str
    time_s: float
    bytes_moved: float  # per rank, forward and backward
    why: str
    feasible: bool = True

    def row(self) -> str:
        note = "" if self.feasible else " (not a candidate)"
        return f"{self.route:<7} {self.time_s * 1e3:8.3f} ms, moves {fmt_bytes(self.bytes_moved)}{note}: {self.why}"


def _a2a(machine: Machine, nbytes: float, world_size: int) -> float:
    return machine.transfer(nbytes, max(1, math.ceil(math.log2(world_size))))


def estimate_routes(shape: ScanShape, machine: Machine) -> list[RouteEstimate]:
    c, b, n = shape.world_size, shape.batch, shape.local_len
    share = (c - 1) / c  # of an exchanged buffer, what goes to the other ranks
    inputs, outputs = (share * b * n * width * shape.itemsize for width in (shape.in_width, shape.out_width))
    heads = RouteEstimate(
        "heads",
        2 * (_a2a(machine, inputs, c) + _a2a(machine, outputs, c)),  # forward; the backward the same again
        2 * (inputs + outputs),
        "all-to-all of the scan's inputs and outputs; bytes grow with the sequence",
    )
    d1, d2 = shape.state_dims
    summary = d1 * (d1 + d2) if shape.kind == "delta_rule" else d1 * d2 + 1
    gathered = share * c * shape.chunks * b * shape.heads * summary * 4  # fp32; the backward reduce-scatters
    if shape.kind == "delta_rule":  # d_k more value columns in the scan, the read of the entering state
        extra = b * n * shape.heads * (4 * d1 * d1 + 2 * 64 * d1) + 2 * b * n * shape.heads * d1 * d2
    else:  # the correction by the entering state
        extra = 2 * b * n * shape.heads * d1 * d2
    extra = 3 * extra + 2 * c * shape.chunks * b * shape.heads * summary * d1  # backward twice; the fold
    saves = 2 * gathered < heads.bytes_moved  # where it does not, the all-to-all, exact to the bit per head
    states = RouteEstimate(
        "states",
        2 * _a2a(machine, gathered, c) + extra / machine.flops,
        2 * gathered,
        "all-gather of one fp32 summary per chunk; bytes independent of the sequence, extra compute"
        if saves
        else "moves more bytes than the all-to-all at this length",
        feasible=saves,
    )
    return [heads, states]


def choose_route(shape: ScanShape, machine: Machine) -> tuple[RouteEstimate, list[RouteEstimate]]:
    """The fastest candidate route (ties: the heads route) and every estimate."""
    estimates = estimate_routes(shape, machine)
    best = estimates[0]  # in ROUTES order: a tie keeps the earlier (a loop, which Dynamo traces)
    for estimate in estimates[1:]:
        if estimate.feasible and estimate.time_s < best.time_s:
            best = estimate
    return best, estimates


__all__ = ["ROUTES", "RouteEstimate", "ScanShape", "choose_route", "estimate_routes"]
