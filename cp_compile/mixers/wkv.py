"""RWKV's WKV recurrence by state passing, and its token shift by a one-token halo.

WKV keeps, per channel, a numerator and a denominator that decay by ``exp(w)`` (``w = -exp(time_decay) < 0``) each
token and take ``exp(k_t) v_t`` and ``exp(k_t)``; token ``t`` reads ``(N_{t-1} + exp(u + k_t) v_t) / (D_{t-1} +
exp(u + k_t))``. The state is linear, but the output is a ratio of it, so a chunk's outputs cannot be corrected after
the fact as ``state`` does for the others: each rank runs the model's own WKV over each of its chunks once, from the
state that enters it. That state comes from one summary per chunk, ``(n w, N, D)`` of the chunk alone, computed in
closed form (``N = sum_s exp(w (n - 1 - s) + k_s) v_s``: no scan), all-gathered and folded in sequence order
(``state._entering``). The model keeps its state as ``(num, den, m)`` with ``N = num exp(m)``; the summaries and the
fold keep the same form, fp32 at least, so no exponent overflows.

A zero token is not neutral here (``exp(0) = 1``): a packed document's chunk is padded behind its tokens
(``_Pieces(pad_at_end=True)``), where what the padding does is never read. RWKV reads no documents: one process
runs the recurrence and the shift through packed documents, and so does this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import Sharding
from .conv import with_halo, without_halo
from .state import _entering, _Pieces

# (time_decay, time_first, key [N, l, W], value [N, l, W], state=[num, den, m] each [N, W]) -> (output, state): the
# model's own WKV
Wkv = Callable[..., tuple[Tensor, object]]


def _summaries(w: Tensor, key: Tensor, value: Tensor, real: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Each row's log decay ``[N, W]`` and its state from zero ``[N, W, 3]`` (num, den, m), rows' real tokens first."""
    rows, length, _ = key.shape
    count = torch.full((rows,), length, device=key.device) if real is None else real.sum(1)
    after = (count[:, None] - 1 - torch.arange(length, device=key.device)).to(key.dtype)  # tokens after each
    exponent = w * after[..., None] + key
    if real is not None:
        exponent = exponent.masked_fill(~real[..., None], float("-inf"))
    top = exponent.amax(1).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row without tokens: a zero state
    weights = torch.exp(exponent - top[:, None])
    summary = torch.stack([(weights * value).sum(1), weights.sum(1), top], -1)
    return w * count[:, None].to(w.dtype), summary


def _fold(decay: Tensor, state: Tensor, summary: Tensor) -> Tensor:
    """The state after a chunk of log decay ``decay`` and summary ``summary`` entered with ``state``."""
    carried = state[..., 2] + decay
    top = torch.maximum(carried, summary[..., 2]).detach()
    kept, added = torch.exp(carried - top), torch.exp(summary[..., 2] - top)
    return torch.stack(
        [kept * state[..., 0] + added * summary[..., 0], kept * state[..., 1] + added * summary[..., 1], top], -1
    )


def wkv_states(
    wkv: Wkv,
    time_decay: Tensor,
    time_first: Tensor,
    key: Tensor,
    value: Tensor,
    sharding: Sharding,
    initial_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``wkv``'s output for this rank's tokens ``key, value [B, L, W]`` over the whole sequence, and the state after
    its last token ``[B, W, 3]`` (num, den, m; the same on every rank); ``initial_state``: the state before the
    first."""
    b, local_len, width = key.shape
    sharding.agree("wkv", (key, value, time_decay))
    pieces = _Pieces(sharding, local_len, b, pad_at_end=True)
    keys, values = pieces.split(key), pieces.split(value)
    acc = torch.promote_types(value.dtype, torch.float32)
    w = -torch.exp(time_decay).to(acc)
    decay, summary = _summaries(w, keys.to(acc), values.to(acc), pieces.real(key.device))
    entering, last = _entering(
        decay.reshape(b, pieces.count, width),
        summary.reshape(b, pieces.count, width, 3),
        initial_state,
        sharding,
        local_len,
        None,
        fold=_fold,
    )
    entering = entering.reshape(b * pieces.count, width, 3)
    out, _ = wkv(time_decay, time_first, keys, values, state=list(entering.unbind(-1)))
    return pieces.join(out), last


def token_shift(x: Tensor, sharding: Sharding) -> Tensor:
    """``x [B, L, W]`` shifted one token later over the whole sequence (each token gets the one before it, zero
    before the first): the previous token of each chunk's first comes from the rank that holds it (``halo``)."""
    sharding.agree("token_shift", (x, x, x))
    extended = with_halo(x, 1, 2, sharding)
    return without_halo(F.pad(extended, (0, 0, 1, -1)), 1, 2, sharding, x.shape[1])


__all__ = ["token_shift", "wkv_states"]
