"""State passing for linear recurrences: bytes independent of the sequence length.

A linear recurrence is affine in the state it starts from: a chunk of consecutive tokens maps an entering
state S to ``T S + U``, and each of its outputs to its output from a zero state plus a linear read of S.
Each rank runs the unmodified scan over each of its chunks from a zero state (the chunks of a rank side by
side in the batch), the ranks all-gather one summary (fp32 at least) ``(T, U)`` per chunk, every rank folds the
summaries in sequence order (the same arithmetic on every rank), and each chunk's output is corrected by the
state that enters it. The backward is autograd's through all of it; the all-gather's gradient is a
reduce-scatter.

- Gated delta rule and KDA (``T`` a dense ``[d_k, d_k]`` per value head): one call of the scan with ``d_k``
  more value columns, zero values and the identity as their initial state, gives both. The value columns
  evolve independently under the same transitions, so the extra columns' final state is ``T`` and their
  outputs are the read ``R_t`` of the entering state: ``o_t += R_t S``. About twice the scan's compute.
- Mamba2's SSD (``T`` a scalar per head): in closed form from the scan's own arguments,
  ``c_t = A * sum(dt_s, s <= t)``, ``T = exp(c_last)``, ``y_t += exp(c_t) (S C_t)``.

Packed documents (one row, two chunks of unequal length per document and rank): each chunk's real tokens are put
in a row of their own, padded in front with zero tokens (the state starts at zero there and a zero token leaves it
as it is), and the chain of chunks restarts at each document where the kernel restarts (a delta rule given
``cu_seqlens``, a Mamba2 scan given ``seq_idx``) or runs through the documents in sequence order where it does not.
Which rows a rank holds depends on its rank: those tables are read on the host, outside any compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..comm.groups import resolve_group
from ..layout.runs import chunks
from . import Sharding, SideBySide
from .heads import gather_groups, rank_slice


def _chain(sharding: Sharding, local_len: int, restart: bool) -> list[tuple[int, bool]]:
    """Every rank's chunks (``rank * F + j``) in sequence order, each with whether the state restarts from the
    sequence's initial one there (the first real chunk of a document, with ``restart``)."""
    per_rank = chunks(sharding.layout, local_len, sharding.world_size, sharding.cu_seqlens)
    cu = None if sharding.cu_seqlens is None else sharding.cu_seqlens.tolist()
    order = []
    for r, rank_chunks in enumerate(per_rank):
        for j, c in enumerate(rank_chunks):
            first = restart and cu is not None and c.real > 0 and c.start == cu[c.doc]
            order.append((c.start, not c.real, r * len(rank_chunks) + j, first))
    return [(index, first) for _, _, index, first in sorted(order)]


class _Pieces:
    """This rank's chunks side by side in the batch: ``[B, L, ...]`` -> ``[B * F, longest, ...]`` and back.

    Equal chunks (zigzag, contiguous) are a reshape. Packed documents' chunks hold a rank-dependent number of
    real tokens: each is a row of its real tokens, padded in front with zero tokens (``SideBySide`` over this rank's
    slots; a padding slot joins from a zero row), or behind them (``pad_at_end``: a recurrence that a zero token
    does change, whose state after the row is not read)."""

    def __init__(self, sharding: Sharding, local_len: int, batch: int, pad_at_end: bool = False):
        per_rank = chunks(sharding.layout, local_len, sharding.world_size, sharding.cu_seqlens)
        self.count, self.local_len = len(per_rank[0]), local_len
        self.side: Optional[SideBySide] = None
        if sharding.cu_seqlens is not None:
            if batch != 1:
                raise ValueError("packed documents are one row (batch size 1)")
            self.side = _piece_rows(sharding, local_len, pad_at_end)

    def split(self, t: Tensor) -> Tensor:
        if self.side is None:
            return t.reshape(t.shape[0] * self.count, t.shape[1] // self.count, *t.shape[2:])
        return self.side.split(t)

    def join(self, t: Tensor) -> Tensor:
        """``[B * F, longest, ...]`` -> ``[B, L, ...]``."""
        if self.side is None:
            return t.reshape(t.shape[0] // self.count, t.shape[1] * self.count, *t.shape[2:])
        return self.side.join(t)

    def real(self, device) -> Optional[Tensor]:
        """``[F, longest]``: which rows hold a token (None: every one)."""
        return None if self.side is None else self.side.rows.to(device) != self.local_len


@torch._dynamo.disable  # this rank's rows: read on the host, never traced into a graph
def _piece_rows(sharding: Sharding, local_len: int, pad_at_end: bool) -> SideBySide:
    rank = resolve_group(sharding.group_name).rank()
    mine = chunks(sharding.layout, local_len, sharding.world_size, sharding.cu_seqlens)[rank]
    longest = max(1, max(c.real for c in mine))
    rows = torch.full((len(mine), longest), local_len, dtype=torch.long)
    back = torch.full((local_len,), len(mine) * longest, dtype=torch.long)
    for j, c in enumerate(mine):
        slots = torch.arange(c.slot, c.slot + c.real)
        first = 0 if pad_at_end else longest - c.real
        rows[j, first : first + c.real] = slots
        back[slots] = j * longest + torch.arange(first, first + c.real)
    return SideBySide(rows, back)


def _entering(
    transitions: Tensor,
    finals: Tensor,
    start: Optional[Tensor],
    sharding: Sharding,
    local_len: int,
    apply,
    restart: bool = False,
    fold=None,
) -> tuple[Tensor, Tensor]:
    """The state entering each of this rank's chunks, and the state after the last chunk of the sequence.

    ``transitions`` and ``finals`` are this rank's ``[B, F, ...]`` summaries; ``apply(T, S)`` is ``T S``, and the
    state after a chunk ``T S + U``, or ``fold(T, S, U)`` where given (a state kept in a form of its own);
    ``restart``: the state restarts from ``start`` at each packed document."""
    chain = _chain(sharding, local_len, restart)
    pieces = finals.shape[1]
    acc = torch.promote_types(finals.dtype, torch.float32)  # fp32 at least: a chain of products loses bits
    every_t = gather_groups(transitions.to(acc), sharding.group_name)  # [B, C * F, ...], rank-major
    every_u = gather_groups(finals.to(acc), sharding.group_name)
    initial = torch.zeros_like(every_u[:, 0]) if start is None else start.to(acc).expand_as(every_u[:, 0])
    state = initial
    entering: list[Optional[Tensor]] = [None] * every_u.shape[1]
    for index, first in chain:
        if first:
            state = initial
        entering[index] = state
        if fold is None:
            state = apply(every_t[:, index], state) + every_u[:, index]
        else:
            state = fold(every_t[:, index], state, every_u[:, index])
    stacked = torch.stack(entering, 1).reshape(finals.shape[0], sharding.world_size, pieces, *finals.shape[2:])
    mine = rank_slice(stacked.movedim(1, 0).contiguous(), sharding.group_name)[0]  # [B, F, ...]
    return mine, state


# a chain restarting at documents (the scan was given ``given``) needs the tokens sharded as documents, and starts
# each document from zero
def _check_restart(restart: bool, given: str, sharding: Sharding, initial: Optional[Tensor]) -> None:
    if restart and sharding.cu_seqlens is None:
        raise ValueError(f"state passing: {given} given to the scan, but the tokens are not sharded as documents")
    if restart and initial is not None:
        raise ValueError("state passing: an initial state with documents restarting the scan")


def gated_delta_rule_states(
    scan: Callable,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    sharding: Sharding,
    *,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """``scan.gated_delta_rule``'s call and result, by state passing (see the module docstring). ``cu_seqlens``
    (the documents of ``sharding``): the scan restarts at each."""
    restart = cu_seqlens is not None and cu_seqlens.shape[0] > 2
    _check_restart(restart, "cu_seqlens", sharding, initial_state)
    b, local_len, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    pieces = _Pieces(sharding, local_len, b)
    # zero tokens leave the state as it is: e^0 S (I - 0 k k^T) + 0
    extended = torch.cat([value, value.new_zeros(b, local_len, hv, dk)], -1)
    identity = torch.eye(dk, dtype=torch.promote_types(value.dtype, torch.float32), device=value.device)
    start = F.pad(identity, (dv, 0)).expand(b * pieces.count, hv, dk, dv + dk)
    out, final = scan(
        *(pieces.split(t) for t in (query, key, extended)),
        g=pieces.split(g),
        beta=pieces.split(beta),
        initial_state=start,
        output_final_state=True,
        **kwargs,
    )
    final = final.reshape(b, pieces.count, hv, dk, dv + dk)
    entering, last = _entering(
        final[..., dv:], final[..., :dv], initial_state, sharding, local_len, lambda t, s: t @ s, restart
    )  # [B, F, Hv, dk, dv]
    reads = out[..., dv:].reshape(b, pieces.count, -1, hv, dk)
    correction = torch.einsum("bfthk,bfhkv->bfthv", reads.to(entering.dtype), entering)
    out = out[..., :dv].reshape(b, pieces.count, -1, hv, dv) + correction.to(out.dtype)
    return pieces.join(out.flatten(0, 1)), (last if output_final_state else None)


def mamba2_scan_states(
    scan: Callable,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    sharding: Sharding,
    *,
    D: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    initial_states: Optional[Tensor] = None,
    return_final_states: bool = False,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    **kwargs,
):
    """``scan.mamba2_scan``'s call and result, by state passing (see the module docstring). ``seq_idx`` given
    (a kernel restarting at documents), the chain restarts at each document of ``sharding``."""
    restart = kwargs.pop("seq_idx", None) is not None
    _check_restart(restart, "seq_idx", sharding, initial_states)
    b, local_len, heads, p = hidden_states.shape
    pieces = _Pieces(sharding, local_len, b)
    # a zero token adds nothing to the state, and in front of a chunk's tokens the state is zero: what it decays
    # by there changes nothing
    out, final = scan(
        *(pieces.split(t) for t in (hidden_states, dt)),
        A,
        *(pieces.split(t) for t in (B, C)),
        chunk_size,
        D=D,
        dt_bias=dt_bias,
        initial_states=None,
        return_final_states=True,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        **kwargs,
    )
    acc = torch.promote_types(torch.promote_types(dt.dtype, final.dtype), torch.float32)
    step = pieces.split(dt).to(acc) + (dt_bias.to(acc) if dt_bias is not None else 0.0)
    step = torch.clamp(F.softplus(step) if dt_softplus else step, dt_limit[0], dt_limit[1])
    real = pieces.real(dt.device)
    if real is not None:  # the zero tokens in front: no decay of the chunk's own
        step = step * real[..., None]
    # log of the decay from each chunk's start to each of its tokens
    decay = torch.cumsum((step * A.to(acc)).reshape(b, pieces.count, -1, heads), dim=2)
    final = final.to(acc).reshape(b, pieces.count, *final.shape[1:])  # [B, F, H, P, N]
    entering, last = _entering(
        decay[:, :, -1].exp(),
        final,
        initial_states,
        sharding,
        local_len,
        lambda t, s: t[..., None, None] * s,
        restart,
    )
    c_heads = pieces.split(C).to(acc).repeat_interleave(heads // B.shape[2], dim=2)
    c_heads = c_heads.reshape(b, pieces.count, -1, heads, c_heads.shape[-1])
    correction = torch.einsum("bfhpn,bfthn->bfthp", entering, c_heads) * decay.exp()[..., None]
    out = out.reshape(b, pieces.count, -1, heads, p) + correction.to(out.dtype)
    out = pieces.join(out.flatten(0, 1))
    return (out, last) if return_final_states else out


__all__ = ["gated_delta_rule_states", "mamba2_scan_states"]
