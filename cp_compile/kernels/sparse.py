"""Attention of each query over keys picked for it (sparse attention chosen by an indexer, DSA).

``picked_attention(q, keys, values, picks, usable, scale)``: query row ``i`` attends to the keys at ``picks[:, i]``
(``usable`` says which of them it may see), in blocks of rows, by one of two routes:

- gathered: each row reads its own picks (heads x head dim per pick) and scores them alone, where the picks are few
  against the keys (``_GATHER_BELOW``): the work goes with the picks, not the sequence;
- masked: each block scores its rows against every key by one matmul and masks all but the picks, as one process's
  masked attention does, where a row picks a large share of the keys (a matmul that reads every key once per block
  then runs faster on a CPU than a gather of as many keys per row).

Both count a place picked twice once. The memory is one block's scores; the backward recomputes them from the saved
output and log-sum-exp (as flash attention does). Plain torch ops inside a ``torch.autograd.Function``: the same code
eagerly and traced.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .merge import acc_dtype, pivot

# elements of one block's scores or gathered keys (batch x heads x rows x keys or picks) at most: bounds the
# temporaries. 4 MiB in float32: on a CPU, glibc maps a block of 32 MiB fresh from the system each time (its mmap
# threshold stops there), and its page faults cost as much as the operation filling it (1,024 rows x 4,096 keys,
# one thread: 24 ms in one fresh block, 3.5 ms in four reused ones)
_BLOCK_ELEMENTS = 1 << 20
# the gathered route where a row's picks are at most the keys over this. Measured on a CPU, one thread, 1,024 rows
# over 4,096 keys, 8 heads of 64, forward and backward: the masked route 2.5 s to 4.9 s whatever the picks; the
# gathered 0.74 s for 32 picks, 1.8 s for 64, 3.4 s for 128, 9.4 s for 256 (a gather and a small matmul per row)
_GATHER_BELOW = 32


def row_blocks(length: int, row_elements: int) -> list[slice]:
    """Blocks of ``length`` rows, each of at most ``_BLOCK_ELEMENTS`` elements (one, where a row holds more) for rows
    of ``row_elements`` elements: what bounds a blocked computation's temporaries."""
    step = max(1, _BLOCK_ELEMENTS // max(1, row_elements))
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


def counted_once(picks: Tensor, usable: Tensor) -> Tensor:
    """``usable`` with every place picked again in the same row (a cache share's slots may repeat) left out: one
    copy of each place stays usable."""
    marked = torch.where(usable, picks, -1)
    ordered, order = marked.sort(dim=-1)
    again = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    repeated = torch.zeros_like(usable).scatter_(-1, order[..., 1:], again)
    return usable & ~repeated


class _Masked:
    """Rows scored against every key (``[B, Hkv, G, r, T]``), all but their picks masked."""

    def __init__(self, keys: Tensor, values: Tensor, picks: Tensor, usable: Tensor):
        self.keys, self.values, self.picks, self.usable = keys.unsqueeze(2), values.unsqueeze(2), picks, usable

    def row_elements(self, batch_heads: int) -> int:
        return batch_heads * self.keys.shape[3]

    def scores(self, q: Tensor, rows: slice, scale: float) -> Tensor:
        total = self.keys.shape[3]
        # the picks not usable go to a column past the keys; a place picked twice is usable if either says so
        allowed = torch.zeros(*self.picks[:, rows].shape[:2], total + 1, dtype=torch.bool, device=q.device)
        allowed.scatter_(-1, self.picks[:, rows].masked_fill(~self.usable[:, rows], total), True)
        scores = torch.matmul(q, self.keys.transpose(-1, -2)) * scale
        return scores.masked_fill(~allowed[:, None, None, :, :total], float("-inf"))

    def weigh(self, weights: Tensor, rows: slice) -> Tensor:
        return torch.matmul(weights, self.values)

    def grads(self, dout: Tensor, rows: slice) -> Tensor:
        return torch.matmul(dout, self.values.transpose(-1, -2))

    def back(self, dscores: Tensor, weights: Tensor, q: Tensor, dout: Tensor, rows: slice, dkeys, dvalues) -> Tensor:
        dkeys += torch.einsum("bhgrt,bhgrd->bhtd", dscores, q)
        dvalues += torch.einsum("bhgrt,bhgrd->bhtd", weights, dout)
        return torch.matmul(dscores, self.keys)


class _Gathered:
    """Rows scored against their own picks alone (``[B, Hkv, G, r, n]``), each place counted once."""

    def __init__(self, keys: Tensor, values: Tensor, picks: Tensor, usable: Tensor):
        self.keys, self.values = keys, values
        self.picks, self.usable = picks.clamp(0, keys.shape[2] - 1), counted_once(picks, usable)

    def row_elements(self, batch_heads: int) -> int:
        b, hkv, _, d = self.keys.shape
        return max(batch_heads, b * hkv * d) * self.picks.shape[-1]

    def _index(self, rows: slice, dim: int) -> Tensor:
        b, r, n = self.picks[:, rows].shape
        return self.picks[:, rows].reshape(b, 1, r * n, 1).expand(b, self.keys.shape[1], r * n, dim)

    def _read(self, source: Tensor, rows: slice) -> Tensor:
        b, r, n = self.picks[:, rows].shape
        return source.gather(2, self._index(rows, source.shape[-1])).view(b, source.shape[1], r, n, source.shape[-1])

    def scores(self, q: Tensor, rows: slice, scale: float) -> Tensor:
        scores = torch.einsum("bhgrd,bhrnd->bhgrn", q, self._read(self.keys, rows)) * scale
        return scores.masked_fill(~self.usable[:, None, None, rows], float("-inf"))

    def weigh(self, weights: Tensor, rows: slice) -> Tensor:
        return torch.einsum("bhgrn,bhrnd->bhgrd", weights, self._read(self.values, rows))

    def grads(self, dout: Tensor, rows: slice) -> Tensor:
        return torch.einsum("bhgrd,bhrnd->bhgrn", dout, self._read(self.values, rows))

    def back(self, dscores: Tensor, weights: Tensor, q: Tensor, dout: Tensor, rows: slice, dkeys, dvalues) -> Tensor:
        b, hkv = dkeys.shape[:2]
        dk = torch.einsum("bhgrn,bhgrd->bhrnd", dscores, q).reshape(b, hkv, -1, dkeys.shape[-1])
        dv = torch.einsum("bhgrn,bhgrd->bhrnd", weights, dout).reshape(b, hkv, -1, dvalues.shape[-1])
        dkeys.scatter_add_(2, self._index(rows, dkeys.shape[-1]), dk)
        dvalues.scatter_add_(2, self._index(rows, dvalues.shape[-1]), dv)
        return torch.einsum("bhgrn,bhrnd->bhgrd", dscores, self._read(self.keys, rows))


def _route(keys: Tensor, values: Tensor, picks: Tensor, usable: Tensor):
    gathered = picks.shape[-1] * _GATHER_BELOW <= keys.shape[2]
    return (_Gathered if gathered else _Masked)(keys, values, picks, usable)


def _forward(q, keys, values, picks, usable, scale):
    b, hq, length, _ = q.shape
    hkv = keys.shape[1]
    qg = q.view(b, hkv, hq // hkv, length, q.shape[-1])
    route = _route(keys, values, picks, usable)
    outs, lses = [], []
    for rows in row_blocks(length, route.row_elements(b * hq)):
        scores = route.scores(qg[:, :, :, rows], rows, scale)
        top = pivot(scores.amax(dim=-1, keepdim=True))
        weights = torch.exp(scores - top)
        total = weights.sum(dim=-1, keepdim=True)
        outs.append(route.weigh(weights, rows) / total.clamp(min=torch.finfo(total.dtype).tiny))
        lses.append((top + torch.log(total)).squeeze(-1))
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
        route = _route(keys, values, picks, usable)
        for rows in row_blocks(length, route.row_elements(b * hq)):
            q_rows, dout = qg[:, :, :, rows], dog[:, :, :, rows]
            weights = torch.exp(route.scores(q_rows, rows, ctx.scale) - lseg[..., rows, None])
            dscores = weights * (route.grads(dout, rows) - delta[..., rows, None]) * ctx.scale
            dq[:, :, :, rows] = route.back(dscores, weights, q_rows, dout, rows, dkeys, dvalues)
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


__all__ = ["counted_once", "picked_attention", "picks_in_slots", "row_blocks"]
