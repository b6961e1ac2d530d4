"""Attention of each query over keys picked for it (sparse attention chosen by an indexer, DSA).

``picked_attention(q, keys, values, picks, usable, scale)``: query row ``i`` attends to the keys at ``picks[:, i]``
(``usable`` says which of them it may see), in blocks of rows: each block scores its rows against every key by one
matmul and masks all but the picks, as one process's masked attention does (a gather of each row's own picks
reads heads x head dim per pick, and on a CPU runs far slower than the matmul that reads every key once per
block). The memory is one block's scores; the backward recomputes them from the saved output and log-sum-exp (as
flash attention does). Plain torch ops inside a ``torch.autograd.Function``: the same code eagerly and traced.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .merge import acc_dtype, pivot

# elements of one block's scores (batch x heads x rows x keys) at most: bounds the temporaries
_BLOCK_ELEMENTS = 1 << 23


def _blocks(length: int, batch: int, heads: int, keys: int) -> list[slice]:
    step = max(1, _BLOCK_ELEMENTS // max(1, batch * heads * keys))
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


def _scores(q: Tensor, keys: Tensor, picks: Tensor, usable: Tensor, scale: float) -> Tensor:
    """``q [B, Hkv, G, r, D]`` against every key ``keys [B, Hkv, T, D]``: ``[B, Hkv, G, r, T]``, -inf but at the
    ``usable`` of ``picks [B, r, n]``."""
    total = keys.shape[2]
    # the picks not usable go to a column past the keys: a place picked twice (as slots of a cache share may be)
    # is usable if either says so
    allowed = torch.zeros(*picks.shape[:2], total + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(-1, picks.masked_fill(~usable, total), True)
    allowed = allowed[..., :total]
    scores = torch.matmul(q, keys.unsqueeze(2).transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed[:, None, None], float("-inf"))


def _forward(q, keys, values, picks, usable, scale):
    b, hq, length, _ = q.shape
    hkv = keys.shape[1]
    qg = q.view(b, hkv, hq // hkv, length, q.shape[-1])
    outs, lses = [], []
    for rows in _blocks(length, b, hq, keys.shape[2]):
        scores = _scores(qg[:, :, :, rows], keys, picks[:, rows], usable[:, rows], scale)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - pivot(lse).unsqueeze(-1)), values.unsqueeze(2)))
        lses.append(lse)
    out, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
    return out.reshape(b, hq, length, values.shape[-1]), lse.reshape(b, hq, length)


class _PickedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, picks, usable, scale):
        out, lse = _forward(q, keys, values, picks, usable, scale)
        ctx.save_for_backward(q, keys, values, picks, usable, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, keys, values, picks, usable, out, lse = ctx.saved_tensors
        b, hq, length, d = q.shape
        hkv, dv = keys.shape[1], values.shape[-1]
        g = hq // hkv
        qg, dog = q.view(b, hkv, g, length, d), grad_out.view(b, hkv, g, length, dv)
        lseg = pivot(lse).view(b, hkv, g, length)
        # d lse / d score is the weight: a gradient of the lse (attention sinks fold it in) joins -delta
        delta = (grad_out * out).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse
        delta = delta.view(b, hkv, g, length)
        dq = torch.empty_like(qg)
        dkeys, dvalues = torch.zeros_like(keys), torch.zeros_like(values)
        for rows in _blocks(length, b, hq, keys.shape[2]):
            scores = _scores(qg[:, :, :, rows], keys, picks[:, rows], usable[:, rows], ctx.scale)
            weights = torch.exp(scores - lseg[..., rows, None])
            dweights = torch.matmul(dog[:, :, :, rows], values.unsqueeze(2).transpose(-1, -2))
            dscores = weights * (dweights - delta[..., rows, None]) * ctx.scale
            dq[:, :, :, rows] = torch.matmul(dscores, keys.unsqueeze(2))
            dkeys += torch.einsum("bhgrt,bhgrd->bhtd", dscores, qg[:, :, :, rows])
            dvalues += torch.einsum("bhgrt,bhgrd->bhtd", weights, dog[:, :, :, rows])
        return dq.view(b, hq, length, d), dkeys, dvalues, None, None, None


def picked_attention(
    q: Tensor, keys: Tensor, values: Tensor, picks: Tensor, usable: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """``q [B, Hq, L, D]`` against ``keys [B, Hkv, T, D]``, ``values [B, Hkv, T, Dv]`` (GQA), each query row ``i``
    over the keys at ``picks [B, L, n]`` (int64, in [0, T); a place may repeat) that ``usable [B, L, n]``
    allows: (out, lse) in the
    accumulator dtype; a row with nothing usable gets out 0 and lse -inf. Both differentiable in q, keys and
    values."""
    dt = acc_dtype(q.dtype)
    return _PickedAttention.apply(q.to(dt), keys.to(dt), values.to(dt), picks, usable, float(scale))


def picks_in_slots(places: Tensor, query_places: Tensor, slot_places: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """Tokens picked by their place in the sequence (``places [B, n, k]``, below ``limit``), as slots of a share of
    a KV cache whose slots hold the tokens at ``slot_places [L]`` (an empty slot's at ``limit`` or beyond): (picks
    ``[B, n, k]``, usable ``[B, n, k]``) for ``picked_attention``, usable where the slot is here and the query at
    ``query_places [n]`` may see it (not after it)."""
    slot_of = torch.full((limit + 1,), -1, dtype=torch.int64, device=slot_places.device)
    slot_of[slot_places.clamp(max=limit)] = torch.arange(slot_places.numel(), device=slot_places.device)
    slot_of[limit] = -1  # the empty slots'
    slots = slot_of[places.long()]
    usable = (slots >= 0) & (places <= query_places[None, :, None])
    return slots.clamp(min=0), usable


__all__ = ["picked_attention", "picks_in_slots"]
