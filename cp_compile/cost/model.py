"""Which CP schedule each attention site gets, and why: a small cost model.

Every candidate schedule has an estimator: ``(Workload, Machine) -> Estimate``
(time, bytes sent, memory held, feasible or not and why). ``decide``
asks each estimator, drops the
infeasible ones and the ones over the machine's memory limit, and picks the
fastest; ties go to the earlier name in ``SCHEDULES``. Adding a schedule is
one estimator function and one ``ESTIMATORS`` entry.

Model (per rank, forward plus backward when any input requires grad):

- compute: attention FLOPs of the visible part of the mask
  (``4 * B * Hq * S^2 * D * visible / C`` forward, 2.5x that backward) at the
  machine's FLOP rate, plus a fixed overhead per kernel call;
- a transfer of n bytes costs ``latency + n / bandwidth``; an all-to-all or
  all-gather over g ranks sends (g-1)/g of its buffer, its g-1 messages in
  flight together (latency counted log2(g) times);
- overlap: ring transfers run under the previous step's compute, so only what
  exceeds a step's compute is exposed; all-to-all and all-gather transfers
  are exposed in full (the compute needs their result);
- memory: what the schedule holds beyond its inputs and outputs.

Masked sites (FlexAttention, packed varlen) are costed by the same
estimators from a ``Workload`` that also carries ``tiles``: the visible
fraction of every (query rank, key rank) tile of the score matrix, from the
global BlockMask's block counts or from ``cu_seqlens`` and the window
(``cost.masked``). With tiles, a ring step lasts as long as its busiest
rank's visible work, or its transfer when that is longer (a step nobody has
work in still pays its transfer); the all-gather waits for the busiest rank's
whole row; Ulysses sees every token of its heads, so its work is the average
whatever the mask.

Every input (shapes, dtype, mask, C, the plan's options and machine
profile) is the same on every rank, and the arithmetic is deterministic, so
every rank picks the same schedule and builds the same graph. (Were they to
differ anyway, each schedule's ``cp::agree`` carries its name, and the ranks
raise the same error instead of hanging.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..schedules import SCHEDULES  # ties go to the earlier name

# ----------------------------------------------------------------------------
# Machine profiles.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What a rank can do per second. Defaults per device type; ``calibrate`` measures one."""

    device: str
    flops: float  # attention FLOP/s of one rank in its fast dtype (fp32 on CPU, 16-bit on CUDA)
    bandwidth: float  # bytes/s one rank sends to a peer
    latency: float  # seconds per message
    kernel_overhead: float = 20e-6  # seconds per attention kernel call
    memory_limit: Optional[float] = None  # bytes a schedule may hold per site, None: no limit
    source: str = "default"  # "default", "calibrated" or "user"

    def flops_for(self, dtype: torch.dtype) -> float:
        if self.device == "cpu":
            return self.flops * (0.5 if dtype == torch.float64 else 1.0)
        return self.flops * {torch.float32: 0.125, torch.float64: 0.02}.get(dtype, 1.0)

    def transfer(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth

    def __str__(self) -> str:
        return (
            f"{self.device} ({self.source}): {self.flops / 1e9:.3g} GFLOP/s, "
            f"{self.bandwidth / 1e9:.3g} GB/s, {self.latency * 1e6:.3g} us latency"
        )


MACHINES = {
    # one CPU core running the flash kernel; gloo over loopback
    "cpu": Machine("cpu", flops=15e9, bandwidth=2e9, latency=60e-6),
    # one H100-class GPU; NVLink within a node
    "cuda": Machine("cuda", flops=400e12, bandwidth=150e9, latency=15e-6, kernel_overhead=10e-6),
}


def default_machine(device: str) -> Machine:
    return MACHINES.get(device, MACHINES["cpu"])


# ----------------------------------------------------------------------------
# What a site asks for, and what a schedule would cost.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One attention site as the estimators see it (per rank, local shapes)."""

    batch: int
    q_heads: int
    kv_heads: int
    local_len: int
    head_dim: int
    v_dim: int
    dtype: torch.dtype
    world_size: int
    visible: float  # fraction of the global S x S scores the mask keeps
    causal: bool
    backward: bool  # forward and backward, or forward only
    mesh: tuple[int, ...] = ()  # (ring size, all-to-all size) of a 2-D plan, else ()
    # tiles[r][j]: fraction of the (local x local) scores between rank r's queries and rank j's keys
    # the mask keeps; None: ``visible`` spread evenly over ranks and ring steps (a zigzag SDPA site)
    tiles: Optional[tuple[tuple[float, ...], ...]] = None
    # the ring's backward steps run in K/V-head halves (schedules.ring.ring_pass_backward); flex
    # sites do not split: a score_mod may read the head index
    head_halves: bool = True

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def acc_itemsize(self) -> int:
        return 8 if self.dtype == torch.float64 else 4

    def nbytes(self, heads: int, dim: int, itemsize: Optional[int] = None) -> int:
        return self.batch * heads * self.local_len * dim * (itemsize or self.itemsize)

    @property
    def q_bytes(self) -> int:
        return self.nbytes(self.q_heads, self.head_dim)

    def kv_bytes(self, kv_heads: Optional[int] = None, itemsize: Optional[int] = None) -> int:
        h = self.kv_heads if kv_heads is None else kv_heads
        return self.nbytes(h, self.head_dim, itemsize) + self.nbytes(h, self.v_dim, itemsize)

    @property
    def out_bytes(self) -> int:
        return self.nbytes(self.q_heads, self.v_dim)

    @property
    def lse_bytes(self) -> int:
        return self.batch * self.q_heads * self.local_len * self.acc_itemsize

    def forward_flops(self) -> float:
        s = self.local_len * self.world_size
        return 2.0 * self.batch * self.q_heads * s * s * (self.head_dim + self.v_dim) * self.visible / self.world_size

    def tile_flops(self) -> float:
        """Forward FLOPs of one fully visible (local x local) tile."""
        return 2.0 * self.batch * self.q_heads * self.local_len**2 * (self.head_dim + self.v_dim)

    def ring_step_work(self) -> list[float]:
        """Per ring step, the visible fraction of the busiest rank's tile (step i: rank r sees rank r-i's K/V)."""
        c, t = self.world_size, self.tiles
        return [max(t[r][(r - i) % c] for r in range(c)) for i in range(c)]

    def row_work(self) -> float:
        """The busiest rank's visible fraction summed over every rank's keys (its all-gathered work)."""
        return max(sum(row) for row in self.tiles)

    def group_tiles(self, groups: int) -> tuple[tuple[float, ...], ...]:
        """Tiles between groups of ``world_size / groups`` consecutive ranks (the hybrid's ring members)."""
        size = self.world_size // groups
        return tuple(
            tuple(
                sum(self.tiles[r][j] for r in range(g * size, (g + 1) * size) for j in range(h * size, (h + 1) * size))
                / size**2
                for h in range(groups)
            )
            for g in range(groups)
        )


@dataclass
class Estimate:
    schedule: str
    feasible: bool
    reason: str  # why infeasible, or what the schedule does for this site
    time_s: float = math.inf
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bytes_sent: float = 0.0  # per rank
    memory_bytes: float = 0.0  # held beyond inputs and outputs, per rank
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        if not self.feasible:
            return f"{self.schedule:<9} not possible: {self.reason}"
        note = f" [{'; '.join(self.notes)}]" if self.notes else ""
        return (
            f"{self.schedule:<9} {self.time_s * 1e3:9.3f} ms (compute {self.compute_s * 1e3:.3f}, exposed comm "
            f"{self.exposed_comm_s * 1e3:.3f}), sends {fmt_bytes(self.bytes_sent)}, holds "
            f"{fmt_bytes(self.memory_bytes)}{note}"
        )


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _compute(w: Workload, m: Machine, kernel_calls: int) -> tuple[float, float]:
    """(forward, backward) compute seconds; backward 0 for forward-only sites."""
    fwd = w.forward_flops() / m.flops_for(w.dtype) + kernel_calls * m.kernel_overhead
    return fwd, (2.5 * fwd if w.backward else 0.0)


def _exchange(m: Machine, nbytes: float, group: int) -> tuple[float, float]:
    """(seconds, bytes sent) of an all-to-all / all-gather moving ``nbytes`` of buffer over ``group`` ranks."""
    if group <= 1:
        return 0.0, 0.0
    sent = nbytes * (group - 1) / group
    # the messages to the g-1 peers are in flight together: latency grows slowly with g
    return m.transfer(sent, max(1, math.ceil(math.log2(group)))), sent


# ----------------------------------------------------------------------------
# Estimators, one per schedule.
# ----------------------------------------------------------------------------


def _ring_steps(w: Workload, m: Machine) -> tuple[float, list[float], int]:
    """(forward seconds, forward seconds of each step, steps with no visible work on any rank)."""
    c = w.world_size
    if w.tiles is None:
        fwd = _compute(w, m, kernel_calls=c)[0]
        return fwd, [fwd / c] * c, 0
    full = w.tile_flops() / m.flops_for(w.dtype)
    work = w.ring_step_work()
    steps = [x * full + (m.kernel_overhead if x > 0 else 0.0) for x in work]
    return sum(steps), steps, sum(1 for x in work if x == 0)


def estimate_ring(w: Workload, m: Machine) -> Estimate:
    c = w.world_size
    fwd, steps, empty = _ring_steps(w, m)
    bwd = 2.5 * fwd if w.backward else 0.0
    kv, dkv = w.kv_bytes(), w.kv_bytes(itemsize=w.acc_itemsize)
    # the transfer for step i + 1 runs under step i's compute
    hops = steps[:-1]
    exposed = sum(max(0.0, m.transfer(kv, 2) - s) for s in hops)
    sent = (c - 1) * kv
    halves = w.head_halves and w.kv_heads > 1
    if w.backward and c > 1:
        if halves:  # the dK/dV hop under one half of a step, the next K/V under the other
            exposed += sum(max(0.0, m.transfer(t, 2) - 1.25 * s) for s in hops for t in (kv, dkv))
        else:
            exposed += sum(max(0.0, m.transfer(kv + dkv, 2) - 2.5 * s) for s in hops)
        exposed += m.transfer(dkv, 2)  # the last dK/dV hop home
        sent += (c - 1) * kv + c * dkv
    memory = 2 * kv + w.nbytes(w.q_heads, w.v_dim, w.acc_itemsize) + w.out_bytes + 2 * w.lse_bytes
    if w.backward:
        # current K/V, and the incoming K/V with the dK/dV so far, or the dK/dV sent and received;
        # without halves all of those at once. Then the step's partial gradients and the dQ sum.
        travelling = max(kv + dkv, 2 * dkv) if halves else kv + 2 * dkv
        partials = (kv + w.q_bytes) / (2 if halves else 1)
        memory = max(memory, kv + travelling + partials + w.nbytes(w.q_heads, w.head_dim, w.acc_itemsize))
    notes = []
    if w.tiles is not None:
        why = "masked ring: each step as long as its busiest rank's visible work, K/V transfer overlapped with it"
        if empty:
            notes.append(
                f"{empty} of {c} ring steps have no visible work on any rank: nothing to hide the next transfer under"
            )
    elif w.causal:
        why = "causal zigzag ring: equal work per rank and step, K/V transfer overlapped with compute"
    else:
        why = "ring: K/V transfer overlapped with compute"
    return Estimate("ring", True, why, fwd + bwd + exposed, fwd + bwd, exposed, sent, memory, notes)


def estimate_allgather(w: Workload, m: Machine) -> Estimate:
    c = w.world_size
    if w.tiles is None:
        fwd, bwd = _compute(w, m, kernel_calls=2)
    else:  # one kernel over every rank's keys: the busiest rank's row sets the time
        fwd = w.row_work() * w.tile_flops() / m.flops_for(w.dtype) + m.kernel_overhead
        bwd = 2.5 * fwd if w.backward else 0.0
    kv_all = c * w.kv_bytes()
    exposed, sent = _exchange(m, kv_all, c)
    if w.backward:
        t2, s2 = _exchange(m, kv_all, c)  # K/V gathered again
        t3, s3 = _exchange(m, c * w.kv_bytes(itemsize=w.acc_itemsize), c)  # dK/dV reduce-scattered
        exposed, sent = exposed + t2 + t3, sent + s2 + s3
    memory = kv_all + (c * w.kv_bytes(itemsize=w.acc_itemsize) if w.backward else 0)
    return Estimate(
        "allgather",
        True,
        "K/V gathered once per pass; no merge; memory grows with C",
        fwd + bwd + exposed,
        fwd + bwd,
        exposed,
        sent,
        memory,
    )


def _a2a_part(w: Workload, m: Machine, group: int) -> tuple[Optional[str], float, float, float, list[str]]:
    """The all-to-all exchanges of a group of ``group`` ranks: (error, seconds, bytes, memory, notes)."""
    from ..comm.exchange import replicate_kv_heads

    if w.q_heads % group:
        return f"{w.q_heads} query heads do not split over {group} ranks", 0.0, 0.0, 0.0, []
    copies = replicate_kv_heads(w.kv_heads, w.q_heads, group)
    notes = [f"K/V heads replicated x{copies} ({w.kv_heads} -> {w.kv_heads * copies})"] if copies > 1 else []
    kv = w.kv_bytes(w.kv_heads * copies)
    moved = [w.q_bytes, kv, w.out_bytes, w.lse_bytes]  # q, k+v in; out, lse back
    if w.backward:
        moved += [w.out_bytes, w.q_bytes, w.kv_bytes(w.kv_heads * copies)]  # dout in; dq, dk+dv back
    seconds = sent = 0.0
    for nbytes in moved:
        t, s = _exchange(m, nbytes, group)
        seconds, sent = seconds + t, sent + s
    # head-sharded q, k, v, out, lse kept for backward, and one exchange's send + receive buffers
    memory = w.q_bytes + kv + w.out_bytes + w.lse_bytes + 2 * max(w.q_bytes, kv)
    return None, seconds, sent, memory, notes


def estimate_ulysses(w: Workload, m: Machine) -> Estimate:
    err, comm, sent, memory, notes = _a2a_part(w, m, w.world_size)
    if err:
        return Estimate("ulysses", False, err)
    fwd, bwd = _compute(w, m, kernel_calls=1)
    return Estimate(
        "ulysses",
        True,
        "all-to-all to head sharding, one full-sequence kernel, all-to-all back",
        fwd + bwd + comm,
        fwd + bwd,
        comm,
        sent,
        memory,
        notes,
    )


def estimate_hybrid(w: Workload, m: Machine) -> Estimate:
    if len(w.mesh) != 2:
        return Estimate("hybrid", False, "needs a 2-D mesh (ring dim, all-to-all dim) in the plan")
    rings, group = w.mesh
    err, comm, sent, memory, notes = _a2a_part(w, m, group)
    if err:
        return Estimate("hybrid", False, err)
    from ..comm.exchange import replicate_kv_heads

    # the ring then runs over ``rings`` ranks on head-sharded blocks as large as the local ones
    kv_heads = w.kv_heads * replicate_kv_heads(w.kv_heads, w.q_heads, group)
    inner = replace(
        w,
        world_size=rings,
        local_len=w.local_len * group,
        q_heads=w.q_heads // group,
        kv_heads=kv_heads // group,
        mesh=(),
        tiles=None if w.tiles is None else w.group_tiles(rings),
    )
    ring = estimate_ring(inner, m)
    return Estimate(
        "hybrid",
        True,
        f"all-to-all over {group} ranks, then a ring over {rings}",
        ring.time_s + comm,
        ring.compute_s,
        ring.exposed_comm_s + comm,
        ring.bytes_sent + sent,
        ring.memory_bytes + memory,
        notes,
    )


ESTIMATORS: dict[str, Callable[[Workload, Machine], Estimate]] = {
    "ring": estimate_ring,
    "allgather": estimate_allgather,
    "ulysses": estimate_ulysses,
    "hybrid": estimate_hybrid,
}


# ----------------------------------------------------------------------------
# The choice.
# ----------------------------------------------------------------------------


def check_schedule(schedule: str) -> None:
    if schedule != "auto" and schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected 'auto' or one of {SCHEDULES}")


def estimate_all(w: Workload, machine: Machine, available=None) -> list[Estimate]:
    """Every candidate's estimate, in ``SCHEDULES`` order (unavailable ones marked infeasible)."""
    rows = []
    for name in SCHEDULES:
        if name not in ESTIMATORS:
            continue
        if available is not None and name not in available:
            rows.append(Estimate(name, False, "not available for this kind of attention yet"))
            continue
        est = ESTIMATORS[name](w, machine)
        if est.feasible and machine.memory_limit is not None and est.memory_bytes > machine.memory_limit:
            est = replace(
                est,
                feasible=False,
                reason=f"holds {fmt_bytes(est.memory_bytes)}, over the limit {fmt_bytes(machine.memory_limit)}",
            )
        rows.append(est)
    return rows


def pick(estimates: list[Estimate]) -> Estimate:
    feasible = [e for e in estimates if e.feasible]
    if not feasible:
        raise ValueError("no CP schedule fits this attention site: " + "; ".join(e.row() for e in estimates))
    return min(feasible, key=lambda e: e.time_s)  # min keeps the first of equals: SCHEDULES order


def machine_for(options, device: str) -> Machine:
    """The plan's machine profile, or the default one for ``device``."""
    return getattr(options, "machine", None) or default_machine(device)


def decide(
    w: Optional[Workload], machine: Machine, schedule: str, available=None, where: str = "", facts: str = ""
) -> tuple[str, str, list[Estimate]]:
    """(schedule, reason, estimates): the fastest feasible candidate for ``w``, or the forced ``schedule``.

    ``facts`` (what the workload was built from, e.g. a mask's visible fraction) ends the reason.
    A forced schedule that the site's kind offers but cannot run here raises ``ValueError``.
    """
    check_schedule(schedule)
    estimates = estimate_all(w, machine, available) if w is not None else []
    tail = f"; {facts}" if facts else ""
    if schedule != "auto":
        forced = next((e for e in estimates if e.schedule == schedule), None)
        offered = available is None or schedule in available
        if forced is not None and offered and not forced.feasible:
            raise ValueError(f"schedule={schedule!r} cannot run the attention at {where}: {forced.reason}")
        notes = f"; {'; '.join(forced.notes)}" if forced is not None and forced.notes else ""
        return schedule, "chosen by the plan (schedule=...)" + notes + tail, estimates
    best = pick(estimates)
    others = [e for e in estimates if e.feasible and e is not best]
    runner = min(others, key=lambda e: e.time_s) if others else None
    margin = f", {runner.time_s / best.time_s:.2f}x faster than {runner.schedule}" if runner else ""
    notes = f"; {'; '.join(best.notes)}" if best.notes else ""
    return best.schedule, f"auto: {best.reason}; estimated {best.time_s * 1e3:.3f} ms{margin}{notes}{tail}", estimates
