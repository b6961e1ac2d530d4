"""Linear attention with a decay per head (MiniMax's lightning attention), and its state passing under context
parallelism.

    o_t = sum_{j <= t} exp(-s_h (t - j)) (q_t . k_j) v_j

``decayed_linear_attention`` computes it in blocks: inside a block the product of its queries and keys, decayed by
distance and masked to the keys not after each query; across blocks a state ``S = sum_j exp(-s (e - j)) k_j^T v_j``
(``e``: the block's last token) that each later query reads decayed by its distance from ``e``. Memory: one block's
``[block, block]`` scores per head, and the ``[D, D]`` state.

Under CP (``lightning_states``) the decay is a scalar per head, as in Mamba2's SSD: each of a rank's chunks runs from
a zero state (``state._Pieces``: the chunks side by side in the batch), its summary is ``(exp(-s n), S_final)`` for its
``n`` tokens, every rank folds every chunk's summary in sequence order (``state._entering``: one all-gather, fp32 at
least), and each chunk's token ``t`` adds ``exp(-s r_t) q_t S_in``, ``r_t`` its place among the chunk's tokens (from 1)
and ``S_in`` the state entering the chunk. Bytes: one ``[H, D, D]`` summary per chunk, whatever the length.

``lightning_heads`` is the other route: an all-to-all from sequence sharding to head groups, the whole sequence for
this rank's heads, an all-to-all back (``scan``'s exchanges). Its tables of packed documents live inside the exchange
ops, so a compiled graph on packed documents takes it; state passing reads them on the host.

Packed documents: one process runs the recurrence through them, and so do both routes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import Sharding
from .gathered import _real
from .heads import gather_groups
from .scan import _exchange, _mine, _padded
from .state import _entering, _Pieces


def decayed_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, block: int, state: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """``q, k, v [N, H, L, D]``, ``decay [H]`` (``s_h``), ``state [N, H, D, D]`` entering (the state after the token
    before the first; None: zero): (out ``[N, H, L, D]``, the state after the last token), both in the accumulator
    dtype (fp32 at least)."""
    n, heads, length, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    s = decay.to(device=q.device, dtype=acc).reshape(heads, 1)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    carried = q.new_zeros(n, heads, d, v.shape[-1]) if state is None else state.to(acc)
    # a whole block's decays, once: a shorter last block of m tokens reads their first m (queries, pairs) or last m
    # (keys: each key's distance to the block's end)
    full = min(block, length)
    place = torch.arange(1, full + 1, device=q.device, dtype=acc)
    behind = place[:, None] - place[None, :]
    within = torch.where(behind >= 0, torch.exp(-s[..., None] * behind.clamp(min=0)), 0.0)  # [H, block, block]
    query_decay = torch.exp(-s * place)[..., None]  # [H, block, 1]
    key_decay = torch.exp(-s * (full - place))[..., None]
    outs = []
    for start in range(0, length, block):
        qb, kb, vb = (t[:, :, start : start + block] for t in (q, k, v))
        m = qb.shape[2]
        out = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * within[:, :m, :m], vb)
        out = out + torch.matmul(qb * query_decay[:, :m], carried)
        outs.append(out)
        keys = (kb * key_decay[:, full - m :]).transpose(-1, -2)
        carried = carried * torch.exp(-s * m)[..., None] + torch.matmul(keys, vb)
    return torch.cat(outs, 2), carried


def lightning_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    block: int,
    sharding: Sharding,
    initial_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``decayed_linear_attention`` of this rank's tokens ``q, k, v [B, L, H, D]`` (the plan's shard) over the whole
    sequence, by state passing (see the module docstring): (out ``[B, L, H, D]`` in q's dtype, the state after the
    sequence's last token, the same on every rank); ``initial_state [B, H, D, D]``: the state before its first."""
    b, local_len, heads, d = q.shape
    pieces = _Pieces(sharding, local_len, b)
    q_p, k_p, v_p = (pieces.split(t).transpose(1, 2) for t in (q, k, v))  # [B * F, H, l, D]
    out, final = decayed_linear_attention(q_p, k_p, v_p, decay, block)
    acc = final.dtype
    s = decay.to(device=q.device, dtype=acc).reshape(1, heads, 1)
    real = pieces.real(q.device)  # packed documents: zero tokens in front of each chunk's own
    if real is None:
        place = torch.arange(1, q_p.shape[2] + 1, device=q.device, dtype=acc).expand(q_p.shape[0], -1)
    else:
        place = real.cumsum(1).to(acc).repeat(b, 1)
    tokens = place[:, -1]  # each chunk's count of tokens
    totals = torch.exp(-s[..., 0] * tokens[:, None]).reshape(b, pieces.count, heads)
    finals = final.reshape(b, pieces.count, heads, d, v.shape[-1])
    entering, last = _entering(
        totals, finals, initial_state, sharding, local_len, lambda t, state: t[..., None, None] * state
    )
    reads = q_p.to(acc) * torch.exp(-s * place[:, None, :])[..., None]
    out = out + torch.matmul(reads, entering.reshape(-1, heads, d, v.shape[-1]))
    return pieces.join(out.to(q.dtype).transpose(1, 2)), last


def lightning_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    block: int,
    sharding: Sharding,
    initial_state: Optional[Tensor] = None,
    final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``lightning_states``'s result by the all-to-all to head groups (see the module docstring); the state after the
    last token only with ``final_state`` (it reads the documents' length on the host)."""
    b, local_len, heads, d = q.shape
    padded = _padded(heads, sharding)
    qh, kh, vh = _exchange([q, k, v], padded, sharding, to_groups=True)  # [B, T, H / C, D], sequence order
    total = qh.shape[1]
    real = _real(local_len, sharding) if final_state else total
    # a zero head (heads padded to C's multiple) reads and writes nothing: its decay is left at zero
    own_decay = _mine(decay.reshape(heads, 1).to(torch.promote_types(q.dtype, torch.float32)), padded, sharding)[:, 0]
    start = None
    if initial_state is not None:
        start = _mine(initial_state.movedim(1, 0), padded, sharding).movedim(0, 1)
    # the padding slots after the last token would decay the final state: left out when it is kept
    streams = (t[:, :real].transpose(1, 2) for t in (qh, kh, vh))
    out, state = decayed_linear_attention(*streams, own_decay, block, start)
    out = torch.nn.functional.pad(out.to(q.dtype).transpose(1, 2), (0, 0, 0, 0, 0, total - real))
    (out,) = _exchange([out], padded, sharding, to_groups=False)
    out = out[:, :, :heads]
    if not final_state:
        return out, None
    return out, gather_groups(state, sharding.group_name)[:, :heads]


def lightning(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    block: int,
    sharding: Sharding,
    route: str,
    initial_state: Optional[Tensor] = None,
    final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """The decayed linear attention of this rank's tokens over the whole sequence by ``route``: ``"states"``
    (``lightning_states``) or ``"heads"`` (``lightning_heads``). Every rank checks every rank's inputs first."""
    sharding.agree("lightning", (q, k, v), f"route={route} block={block}")
    if route == "states":
        return lightning_states(q, k, v, decay, block, sharding, initial_state)
    return lightning_heads(q, k, v, decay, block, sharding, initial_state, final_state)


__all__ = ["decayed_linear_attention", "lightning", "lightning_heads", "lightning_states"]
