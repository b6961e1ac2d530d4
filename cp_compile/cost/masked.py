"""What the cost model needs to know about masked sites: packed documents and FlexAttention.

Besides shapes, the estimators in ``cost.model`` read ``Workload.tiles``:
the fraction of every (query rank, key rank) tile of the score matrix that
the mask keeps. A ring step whose tiles are empty on every rank still pays
its transfer; an all-gather waits for the busiest rank's whole row; Ulysses
sees every token of its heads. The tiles come from global facts only, the
same on every rank, and are counted in integers, so every rank builds the
same workload and picks the same schedule:

- packed (THD + ``cu_seqlens``): exactly, from the documents and the window,
  under the per-document zigzag (``packed_tiles``), when an eager call holds
  ``cu_seqlens``. In a compiled graph it is a run-time input and one graph
  serves every split, so the site is costed as one document over the whole
  sequence (the most a window can see), and the reason says so.
- FlexAttention: from the global BlockMask's block counts (visible blocks,
  full or partial), recorded by ``ContextParallel.shard(block_mask)`` on the
  sharded mask (eager) and keyed by local length and C (compiled: the last
  mask sharded for that length). No block_mask: every pair is visible.

``choose_packed`` and ``choose_flex`` serve the eager API, ``choose_site`` the
compiled rewrite; all three end in ``choose_masked``, so eager and compiled
calls with the same facts choose the same. ``choose_schedule`` is Stage 1's
entry for every site pattern.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..layout.blockmask import sharded_mask_mod
from ..layout.packed import check_cu_seqlens, packed_local_len
from .model import Estimate, Machine, Workload, decide, default_machine

Tiles = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class MaskFacts:
    """The tiles of a masked site and where they came from (for the reason)."""

    tiles: Tiles
    source: str

    @property
    def visible(self) -> float:
        c = len(self.tiles)
        return sum(map(sum, self.tiles)) / (c * c)

    def describe(self) -> str:
        c = len(self.tiles)
        busy = sum(1 for r in range(c) for j in range(c) if r != j and self.tiles[r][j] > 0)
        return (
            f"mask: {self.source}; {self.visible:.1%} of scores visible, {busy} of {c * (c - 1)} remote tiles "
            "have visible pairs"
        )


def full_tiles(world_size: int) -> Tiles:
    return tuple((1.0,) * world_size for _ in range(world_size))


# ----------------------------------------------------------------------------
# Packed documents.
# ----------------------------------------------------------------------------


def packed_tiles(cu_seqlens, world_size: int, left: int, right: int) -> Tiles:
    """tiles[r][j]: visible (query slot of rank r, key slot of rank j) pairs over local_len^2, exactly."""
    return _packed_tiles(tuple(check_cu_seqlens(cu_seqlens)), world_size, left, right)


def _below(y: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """sum of min(z, width) over the integers 1 <= z < y (0 where y <= 1)."""
    t = torch.minimum((y - 1).clamp(min=0), width)
    return t * (t + 1) // 2 + (y - 1 - width).clamp(min=0) * width


def _visible(start_gap, wa, wb, left: int, right: int) -> torch.Tensor:
    """Visible (query, key) pairs between a query run of ``wa`` positions and a key run of ``wb`` positions
    starting ``start_gap`` after it, in one document: -right <= query - key <= left (-1: unbounded)."""

    def at_most(x: int) -> torch.Tensor:  # pairs with query - key <= x
        y0 = start_gap + x + 1  # key q sees clamp(q - key start + y0, 0, wa) such queries
        return _below(y0 + wb, wa) - _below(y0, wa)

    pairs = at_most(left) if left >= 0 else (wa * wb).expand(torch.broadcast_shapes(start_gap.shape, wa.shape))
    return pairs - at_most(-right - 1) if right >= 0 else pairs


@functools.lru_cache(maxsize=64)
def _packed_tiles(cu: tuple, world_size: int, left: int, right: int) -> Tiles:
    """Visible pairs per (rank, rank) under the per-document zigzag, in closed form.

    A document of n tokens is cut into chunks of m = ceil(n / 2C): f = n // m full ones, then one of
    e = n - f m tokens when e > 0; rank r holds chunks r and 2C-1-r. Between two full chunks a and b the
    count depends on b - a alone, so per document only 4C-1 offsets are evaluated (and 2C pairs with its
    partial chunk): O(documents x C) work, exact integers, whatever the lengths.
    """
    c = world_size
    two_c = 2 * c
    local = packed_local_len(list(cu), c)
    n = torch.tensor(cu[1:], dtype=torch.int64) - torch.tensor(cu[:-1], dtype=torch.int64)
    n, copies = torch.unique(n[n > 0], return_counts=True)  # documents of one length count alike
    if local == 0 or n.numel() == 0:
        return tuple((0.0,) * c for _ in range(c))
    m = (n + two_c - 1) // two_c
    f = n // m
    e = n - f * m
    col = lambda t: t[:, None]  # noqa: E731  (per document, broadcast over chunks or offsets)
    chunk_sums = torch.zeros(two_c * two_c, dtype=torch.int64)  # [query chunk a, key chunk b], flattened

    # full x full: phi[d, b - a] for offsets -(2C-1) .. 2C-1, counted where both chunks are below f
    offsets = torch.arange(-(two_c - 1), two_c, dtype=torch.int64)
    phi = _visible(offsets[None, :] * col(m), col(m), col(m), left, right) * col(copies)  # [D, 4C-1]
    by_full = torch.zeros(two_c + 1, offsets.numel(), dtype=torch.int64).index_add_(0, f, phi)
    beyond = by_full.flip(0).cumsum(0).flip(0)  # beyond[t]: documents with f >= t
    a, b = torch.arange(two_c)[:, None], torch.arange(two_c)[None, :]
    chunk_sums += beyond[torch.maximum(a, b) + 1, b - a + two_c - 1].flatten()

    # the partial chunk (index f, e tokens) against every full chunk, both ways, and itself
    part = e > 0
    if bool(part.any()):
        m, f, e, copies = m[part], f[part], e[part], copies[part]
        chunks = torch.arange(two_c, dtype=torch.int64)[None, :]
        full = chunks < col(f)
        gap = (chunks - col(f)) * col(m)  # key chunk b's start after the partial chunk's
        as_query = torch.where(full, _visible(gap, col(e), col(m), left, right), 0) * col(copies)
        as_key = torch.where(full, _visible(-gap, col(m), col(e), left, right), 0) * col(copies)
        itself = _visible(torch.zeros_like(e), e, e, left, right) * copies
        chunk_sums.index_add_(0, (col(f) * two_c + chunks).flatten(), as_query.flatten())
        chunk_sums.index_add_(0, (chunks.t() * two_c + f[None, :]).t().flatten(), as_key.flatten())
        chunk_sums.index_add_(0, f * two_c + f, itself)

    owner = torch.arange(two_c)
    owner = torch.where(owner < c, owner, two_c - 1 - owner)  # rank of each chunk
    fold = torch.zeros(two_c, c, dtype=torch.int64)
    fold[torch.arange(two_c), owner] = 1
    counts = (fold.t() @ chunk_sums.view(two_c, two_c) @ fold).tolist()
    return tuple(tuple(x / local**2 for x in row) for row in counts)


def packed_facts(cu_seqlens, local_len: int, world_size: int, window: tuple[int, int]) -> MaskFacts:
    """From ``cu_seqlens`` (an eager call), else as one document over the whole sequence.

    A compiled site's documents are a run-time input: one graph serves every split, so its
    schedule is costed from what holds for every split, the shapes and the window, with the
    documents taken as one covering everything (the most any query can see).
    """
    left, right = window
    shape = f"window ({left}, {right})"
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens)
        source = f"{shape} over {len(cu) - 1} documents (cu_seqlens)"
    else:
        total = local_len * world_size
        cu = [0, total]
        source = (
            f"{shape}; the documents are a run-time input (one graph for every split): costed as one "
            f"document of {total} tokens, the most any split can see"
        )
    return MaskFacts(packed_tiles(cu, world_size, left, right), source)


# ----------------------------------------------------------------------------
# FlexAttention.
# ----------------------------------------------------------------------------


def flex_facts(tiles: Optional[tuple], has_mask: bool, local_len: int, world_size: int) -> MaskFacts:
    """From a sharded mask's tile fractions (``layout.blockmask``; None: not known for this length and C), or
    every pair visible without a block_mask."""
    if not has_mask:
        return MaskFacts(full_tiles(world_size), "no block_mask: every pair visible")
    if tiles is None:
        return MaskFacts(
            full_tiles(world_size),
            f"no BlockMask sharded by plan.shard for local length {local_len} at "
            f"C={world_size}: every pair counted as visible",
        )
    return MaskFacts(tiles, "global BlockMask's block counts (plan.shard)")


# ----------------------------------------------------------------------------
# The choice, eager and compiled.
# ----------------------------------------------------------------------------


def choose_masked(
    kind: str,
    q_shape,
    k_shape,
    v_shape,
    dtype: torch.dtype,
    world_size: int,
    facts: MaskFacts,
    *,
    causal: bool,
    backward: bool,
    machine: Machine,
    mesh: tuple = (),
    schedule: str = "auto",
    where: str = "",
) -> tuple[str, str, list[Estimate]]:
    """(schedule, reason, estimates) of a call of attention kind ``"packed"`` (shapes [T, H, D]) or ``"flex"``
    (shapes [B, H, S, D]), local shapes."""
    if kind == "packed":
        batch, (local, q_heads, head_dim), kv_heads, v_dim = 1, q_shape, k_shape[1], v_shape[-1]
    else:
        (batch, q_heads, local, head_dim), kv_heads, v_dim = q_shape, k_shape[1], v_shape[-1]
    w = Workload(
        batch,
        q_heads,
        kv_heads,
        local,
        head_dim,
        v_dim,
        dtype,
        world_size,
        facts.visible,
        causal,
        backward,
        tuple(mesh),
        tiles=facts.tiles,
        head_halves=kind == "packed",
    )
    return decide(w, machine, schedule, None, where, facts.describe())


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def choose_packed(
    q, k, v, cu_seqlens, world_size: int, window: tuple[int, int], machine: Optional[Machine] = None, mesh: tuple = ()
) -> tuple[str, str, list[Estimate]]:
    """Eager ``varlen_attention(schedule="auto")``: [T, H, D] q, k, v and the global ``cu_seqlens``.

    Every layer of a model's forward asks the same question (the same documents and shapes): answered once."""
    cu = None if cu_seqlens is None else tuple(check_cu_seqlens(cu_seqlens))
    machine = machine or default_machine(q.device.type)
    schedule, reason, estimates = _choose_packed(
        cu,
        (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
        q.dtype,
        world_size,
        tuple(window),
        _needs_grad(q, k, v),
        machine,
        tuple(mesh),
    )
    return schedule, reason, [replace(e, notes=list(e.notes)) for e in estimates]  # the caller's own


@functools.lru_cache(maxsize=64)
def _choose_packed(
    cu, shapes: tuple, dtype: torch.dtype, world_size: int, window: tuple, backward: bool, machine: Machine, mesh: tuple
) -> tuple[str, str, tuple[Estimate, ...]]:
    facts = packed_facts(cu, shapes[0][0], world_size, window)
    schedule, reason, estimates = choose_masked(
        "packed",
        *shapes,
        dtype,
        world_size,
        facts,
        causal=window[1] == 0,
        backward=backward,
        machine=machine,
        mesh=mesh,
    )
    return schedule, reason, tuple(estimates)


def choose_flex(
    q, k, v, block_mask, world_size: int, machine: Optional[Machine] = None, mesh: tuple = ()
) -> tuple[str, str, list[Estimate]]:
    """Eager ``flex_attention(schedule="auto")``: [B, H, S, D] q, k, v and the sharded BlockMask (or None)."""
    sharded = sharded_mask_mod(block_mask)
    tiles = None if sharded is None else sharded.tiles_for(q.shape[2], world_size)
    facts = flex_facts(tiles, block_mask is not None, q.shape[2], world_size)
    return choose_masked(
        "flex",
        tuple(q.shape),
        tuple(k.shape),
        tuple(v.shape),
        q.dtype,
        world_size,
        facts,
        causal=False,
        backward=_needs_grad(q, k, v),
        machine=machine or default_machine(q.device.type),
        mesh=mesh,
    )
