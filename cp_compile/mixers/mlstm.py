"""xLSTM's mLSTM cell by state passing.

The mLSTM keeps per head a matrix memory ``C``, a normalizer ``n`` and a running maximum ``m`` of its log gates:
token ``t`` with forget gate ``f_t`` (``log sigmoid``) and input gate ``i_t`` (log space) sets ``m_t = max(m_{t-1} +
log f_t, i_t)``, ``C_t = exp(m_{t-1} + log f_t - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T`` and ``n_t`` likewise with
``k_t``, and reads ``q_t C_t / max(|q_t . n_t|, exp(-m_t))``. ``m`` is not only a stabilizer: the output's lower bound
reads it, so the state passed between chunks carries the true running maximum, which composes as a (max, +)
recurrence: a chunk of total log forget ``G`` entered with ``m`` leaves ``max(m + G, a)``, ``a`` the chunk's own
maximum of ``i_s + (log f after s)``.

Each rank computes one summary ``(G, C, n, a)`` per chunk in closed form (the sums the model's chunkwise kernel forms
per chunk: ``C = sum_s exp(i_s + log f after s - a) k_s v_s^T``), the ranks all-gather them, every rank folds them in
sequence order (``state._entering``) from the model's own initial state (zeros, ``m = 0``), and each chunk runs the
model's own kernel from the state that enters it, which gives its outputs exactly as one process's. Packed documents'
chunks are padded behind their tokens (a zero token decays the state); xLSTM reads no documents, so the state runs
through them as one process runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import Sharding
from .state import _entering, _Pieces

# (query, key, value, igate, fgate, c, n, m) -> (h, last state): the model's mLSTM from an entering state, tokens along
# dim 2 of [N, H, l, D] (gates [N, H, l]); c [N, H, dk, dv], n [N, H, dk], m [N, H, 1]
Mlstm = Callable[..., tuple[Tensor, object]]


def _summaries(key: Tensor, value: Tensor, igate: Tensor, fgate: Tensor, real: Optional[Tensor]):
    """Each row's total log forget gate ``[N, H]`` and its state from nothing packed as ``[N, H, dk, dv + 2]``
    (C, then n, then the maximum ``a`` in every row of dk), the rows' real tokens first (token-major inputs)."""
    log_f = F.logsigmoid(fgate)
    if real is not None:
        log_f = torch.where(real[..., None], log_f, torch.zeros_like(log_f))
        igate = torch.where(real[..., None], igate, torch.full_like(igate, float("-inf")))
    total = log_f.sum(1)
    gains = igate + (total[:, None] - log_f.cumsum(1))  # [N, l, H]: i_s plus the log forget gates after s
    top = gains.amax(1)  # [N, H]; -inf for a row without tokens
    weights = torch.exp(gains - torch.where(torch.isfinite(top), top, torch.zeros_like(top))[:, None])
    memory = torch.einsum("nlh,nlhk,nlhv->nhkv", weights, key, value)
    normalizer = torch.einsum("nlh,nlhk->nhk", weights, key)
    top_rows = top[..., None, None].expand(*normalizer.shape, 1)
    return total, torch.cat([memory, normalizer[..., None], top_rows], -1)


def _fold(total: Tensor, state: Tensor, summary: Tensor) -> Tensor:
    """The packed state after a chunk of log forget ``total`` and summary ``summary`` entered with ``state``."""
    carried = state[..., :1, -1] + total[..., None]  # [B, H, 1]
    top = torch.maximum(carried, summary[..., :1, -1])
    kept, added = torch.exp(carried - top)[..., None], torch.exp(summary[..., :1, -1] - top)[..., None]
    mixed = kept * state[..., :-1] + added * summary[..., :-1]
    return torch.cat([mixed, top[..., None].expand(*mixed.shape[:-1], 1)], -1)


def mlstm_states(
    mlstm: Mlstm,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    igate: Tensor,
    fgate: Tensor,
    sharding: Sharding,
    initial_state: Optional[tuple[Tensor, Tensor, Tensor]] = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``mlstm``'s output for this rank's tokens (``[B, H, L, D]``, gates ``[B, H, L]``) over the whole sequence, and
    the state after its last token ``(C, n, m)`` (the same on every rank); ``initial_state``: the one before its
    first (None: the model's zeros)."""
    b, heads, local_len, dk = key.shape
    dv = value.shape[-1]
    sharding.agree("mlstm", (query, key, value))
    pieces = _Pieces(sharding, local_len, b, pad_at_end=True)
    q, k, v = (pieces.split(t.transpose(1, 2)) for t in (query, key, value))  # [N, l, H, D]
    i, f = (pieces.split(t.transpose(1, 2)) for t in (igate, fgate))  # [N, l, H]
    acc = torch.promote_types(value.dtype, torch.float32)
    total, summary = _summaries(k.to(acc), v.to(acc), i.to(acc), f.to(acc), pieces.real(key.device))
    start = None
    if initial_state is not None:
        c0, n0, m0 = (t.to(acc) for t in initial_state)
        start = torch.cat([c0, n0[..., None], m0[..., None].expand(*n0.shape, 1)], -1)
    entering, last = _entering(
        total.reshape(b, pieces.count, heads),
        summary.reshape(b, pieces.count, heads, dk, dv + 2),
        start,
        sharding,
        local_len,
        None,
        fold=_fold,
    )
    entering = entering.reshape(b * pieces.count, heads, dk, dv + 2)
    c, n, m = entering[..., :dv], entering[..., dv], entering[..., 0, dv + 1 :]
    h, _ = mlstm(*(t.transpose(1, 2) for t in (q, k, v, i, f)), c, n, m)
    out = pieces.join(h.transpose(1, 2)).transpose(1, 2)
    return out, (last[..., :dv], last[..., dv], last[..., 0, dv + 1 :])


__all__ = ["mlstm_states"]
