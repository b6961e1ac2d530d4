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

Only for the layouts of equal chunks (zigzag, contiguous) and one sequence per row: packed documents use the
all-to-all of ``scan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout.runs import chunks
from . import Sharding
from .heads import gather_groups, rank_slice


def _chain(sharding: Sharding, local_len: int) -> list[int]:
    """Every rank's chunks (``rank * F + j``) in sequence order."""
    if sharding.cu_seqlens is not None:
        raise ValueError("state passing runs on one sequence per row; packed documents use the all-to-all")
    per_rank = chunks(sharding.layout, local_len, sharding.world_size)
    starts = [(c.start, r * len(rc) + j) for r, rc in enumerate(per_rank) for j, c in enumerate(rc)]
    return [index for _, index in sorted(starts)]


def _pieces(t: Tensor, pieces: int) -> Tensor:
    """``[B, L, ...]`` -> ``[B * F, L / F, ...]``: this rank's chunks side by side in the batch."""
    return t.reshape(t.shape[0] * pieces, t.shape[1] // pieces, *t.shape[2:])


def _entering(
    transitions: Tensor, finals: Tensor, start: Optional[Tensor], sharding: Sharding, local_len: int, apply
) -> tuple[Tensor, Tensor]:
    """The state entering each of this rank's chunks, and the state after the last chunk of the sequence.

    ``transitions`` and ``finals`` are this rank's ``[B, F, ...]`` summaries; ``apply(T, S)`` is ``T S``."""
    chain = _chain(sharding, local_len)
    pieces = finals.shape[1]
    acc = torch.promote_types(finals.dtype, torch.float32)  # fp32 at least: a chain of products loses bits
    every_t = gather_groups(transitions.to(acc), sharding.group_name)  # [B, C * F, ...], rank-major
    every_u = gather_groups(finals.to(acc), sharding.group_name)
    state = torch.zeros_like(every_u[:, 0]) if start is None else start.to(acc).expand_as(every_u[:, 0])
    entering: list[Optional[Tensor]] = [None] * every_u.shape[1]
    for index in chain:
        entering[index] = state
        state = apply(every_t[:, index], state) + every_u[:, index]
    stacked = torch.stack(entering, 1).reshape(finals.shape[0], sharding.world_size, pieces, *finals.shape[2:])
    mine = rank_slice(stacked.movedim(1, 0).contiguous(), sharding.group_name)[0]  # [B, F, ...]
    return mine, state


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
    """``scan.gated_delta_rule``'s call and result, by state passing (see the module docstring)."""
    if cu_seqlens is not None and cu_seqlens.shape[0] > 2:
        raise ValueError("state passing runs on one sequence per row; packed documents use the all-to-all")
    b, local_len, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    pieces = len(chunks(sharding.layout, local_len, sharding.world_size)[0])
    extended = torch.cat([value, value.new_zeros(b, local_len, hv, dk)], -1)
    identity = torch.eye(dk, dtype=torch.promote_types(value.dtype, torch.float32), device=value.device)
    start = F.pad(identity, (dv, 0)).expand(b * pieces, hv, dk, dv + dk)
    out, final = scan(
        *(_pieces(t, pieces) for t in (query, key, extended)),
        g=_pieces(g, pieces),
        beta=_pieces(beta, pieces),
        initial_state=start,
        output_final_state=True,
        **kwargs,
    )
    final = final.reshape(b, pieces, hv, dk, dv + dk)
    entering, last = _entering(
        final[..., dv:], final[..., :dv], initial_state, sharding, local_len, lambda t, s: t @ s
    )  # [B, F, Hv, dk, dv]
    reads = out[..., dv:].reshape(b, pieces, local_len // pieces, hv, dk)
    correction = torch.einsum("bfthk,bfhkv->bfthv", reads.to(entering.dtype), entering)
    out = out[..., :dv].reshape(b, pieces, local_len // pieces, hv, dv) + correction.to(out.dtype)
    return out.reshape(b, local_len, hv, dv), (last if output_final_state else None)


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
    """``scan.mamba2_scan``'s call and result, by state passing (see the module docstring)."""
    b, local_len, heads, p = hidden_states.shape
    pieces = len(chunks(sharding.layout, local_len, sharding.world_size)[0])
    out, final = scan(
        *(_pieces(t, pieces) for t in (hidden_states, dt)),
        A,
        *(_pieces(t, pieces) for t in (B, C)),
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
    step = dt.to(acc) + (dt_bias.to(acc) if dt_bias is not None else 0.0)
    step = torch.clamp(F.softplus(step) if dt_softplus else step, dt_limit[0], dt_limit[1])
    # log of the decay from each chunk's start to each of its tokens
    decay = torch.cumsum((step * A.to(acc)).reshape(b, pieces, local_len // pieces, heads), dim=2)
    final = final.to(acc).reshape(b, pieces, *final.shape[1:])  # [B, F, H, P, N]
    entering, last = _entering(
        decay[:, :, -1].exp(), final, initial_states, sharding, local_len, lambda t, s: t[..., None, None] * s
    )
    groups = B.shape[2]
    c_heads = C.to(acc).repeat_interleave(heads // groups, dim=2).reshape(b, pieces, local_len // pieces, heads, -1)
    correction = torch.einsum("bfhpn,bfthn->bfthp", entering, c_heads) * decay.exp()[..., None]
    out = out.reshape(b, pieces, local_len // pieces, heads, p) + correction.to(out.dtype)
    out = out.reshape(b, local_len, heads, p)
    return (out, last) if return_final_states else out


__all__ = ["gated_delta_rule_states", "mamba2_scan_states"]
