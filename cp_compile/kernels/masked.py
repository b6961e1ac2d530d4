"""Attention under an explicit visibility: a KV cache's slots by position, and one masked call of CPU's fused kernel.

``positions_attn`` runs queries at global positions against keys at any positions (a rank's share of a
cache, empty slots included); ``fused_masked_attn`` (+ backward) runs a short block whose visibility is given
as a ``[Lq, Lk]`` boolean, where the tiles of ``block`` would cost more in calls and merges than the attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block import aten, soft_cap, tile_fwd
from .merge import acc_dtype, pivot

# Positions far beyond any sequence: a cache slot holding no token carries it and is never visible.
EMPTY_POSITION = 2**62


def positions_visible(q_pos: Tensor, k_pos: Tensor, left: int, chunk: int = 0) -> Tensor:
    """[Lq, Lk] bool: a key is visible to a query when it is not after it and, with ``left >= 0``,
    at most ``left`` positions before it (transformers' window ``w`` is ``left = w - 1``) and, with
    ``chunk > 0``, in the same chunk of ``chunk`` positions (Llama 4's chunked attention). Positions of each
    row of a batch (``q_pos [B, Lq]``, ``k_pos [B, Lk]``: rows of different lengths) give ``[B, Lq, Lk]``."""
    behind = q_pos[..., :, None] - k_pos[..., None, :]
    visible = behind >= 0
    if left >= 0:
        visible &= behind <= left
    if chunk > 0:
        visible &= (q_pos[..., :, None] // chunk) == (k_pos[..., None, :] // chunk)
    return visible


def _per_folded_row(visible: Tensor, group: int) -> Tensor:
    """``positions_visible``'s mask for the rows of ``_fold_groups``: ``[G*Lq, Lk]``, or ``[B, 1, G*Lq, Lk]`` for
    positions per batch row."""
    if visible.dim() == 2:
        return visible.repeat(group, 1)
    return visible.repeat(1, group, 1).unsqueeze(1)


def positions_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    left: int,
    scale: float,
    rows_per_block: int = 1024,
    chunk: int = 0,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Queries at global positions ``q_pos`` against keys at ``k_pos`` (any order, empty slots at
    ``EMPTY_POSITION``): (out, lse) in the accumulator dtype; a row that sees no key gets out 0,
    lse -inf (a rank's share of a cache may hold nothing a query may see).

    The math path, ``rows_per_block`` query rows at a time so that a long multi-token step keeps its
    score matrix bounded. The query heads sharing a key/value head are folded into the rows, so each
    matmul reads the cache in place (a broadcast over the group would copy it once per query head).
    """
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dt = acc_dtype(q.dtype)
    fused = not softcap and fused_masked_ready(q, k, v)
    keys, values = (k, v) if fused else (k.to(dt), v.to(dt))
    outs, lses = [], []
    for start in range(0, lq, rows_per_block):
        rows = slice(start, start + rows_per_block)
        n = q[:, :, rows].shape[2]
        qg = _fold_groups(q[:, :, rows].to(dt), hkv)
        visible = _per_folded_row(positions_visible(q_pos[..., rows], k_pos, left, chunk), group)
        if fused:
            out, lse = _fused_masked(qg, keys, values, visible, scale)
        else:
            s = soft_cap(torch.matmul(qg, keys.transpose(-1, -2)) * scale, softcap).masked_fill(~visible, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)
            out = torch.matmul(torch.exp(s - pivot(lse).unsqueeze(-1)), values)
        outs.append(out.reshape(b, hq, n, v.shape[-1]))
        lses.append(lse.reshape(b, hq, n))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def every_key_attn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the accumulator dtype) of queries that see every key (a decoded token against the
    cache slots written so far): one call of the fused kernel without a mask, the query heads of a key/value head
    folded into rows, so that the cache is read in place."""
    b, hq, lq, _ = q.shape
    out, lse = tile_fwd(_fold_groups(q, k.shape[1]), k, v, False, scale)
    return out.reshape(b, hq, lq, v.shape[-1]), lse.reshape(b, hq, lq)


def visible_attn(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the accumulator dtype) of ``q [B, Hq, Lq, D]`` against ``k, v`` (GQA) where
    ``visible [Lq, Lk]`` (or ``[B, Lq, Lk]``), every row seeing some key, as plain torch ops that a compiler lowers
    whole: SDPA for the output, the log-sum-exp from the scores beside it, which a compiled graph drops where nothing
    reads it."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=visible if visible.dim() == 2 else visible[:, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    b, hq, lq, _ = q.shape
    dt = acc_dtype(q.dtype)
    scores = torch.matmul(_fold_groups(q.to(dt), k.shape[1]), k.to(dt).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~_per_folded_row(visible, hq // k.shape[1]), float("-inf")), dim=-1)
    return out, lse.reshape(b, hq, lq)


def fused_masked_ready(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """CPU's fused kernel takes a mask and returns lse; it computes in the inputs' dtype, so only where that is
    the accumulator dtype (fp32, fp64), and it cannot apply a soft-cap.

    Its mask is an additive bias, which a key holding NaN or inf survives (NaN - inf is NaN) in the rows that
    must not see it: callers whose masked keys may hold anything (a training batch's) check ``all_finite``
    first. A KV cache's masked slots are zeros or keys the model made, which a NaN would have poisoned first."""
    return q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == acc_dtype(q.dtype) and q.shape[-1] == v.shape[-1]


def all_finite(k: Tensor) -> bool:
    """No NaN or inf in ``k``: one pass over it and a host read, for the CPU paths of ``fused_masked_ready``."""
    return bool(torch.isfinite(k).all())


def _bias(visible: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _fused_masked(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``q`` against ``k, v`` where ``visible [Lq, Lk]``; a row that sees nothing gets out 0 and lse
    -inf (the kernel returns lse 0 for it)."""
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_bias(visible, q.dtype), scale=scale
    )
    return out, lse.masked_fill(~visible.any(-1), float("-inf"))


def _fold_groups(t: Tensor, kv_heads: int) -> Tensor:
    """``[B, Hq, L, D]`` as ``[B, Hkv, G*L, D]``: the query heads of one key/value head as rows, so the kernel
    reads each key/value head once (query head h reads key/value head h // G)."""
    b, hq, length, d = t.shape
    return t.reshape(b, kv_heads, hq // kv_heads * length, d)


def fused_masked_attn(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of a block where ``visible [Lq, Lk]``, as one call of CPU's fused kernel (``fused_masked_ready``);
    every row must see a key. For short blocks whose tiles would each cost a call and a merge."""
    b, hq, lq, _ = q.shape
    out, lse = _fused_masked(_fold_groups(q, k.shape[1]), k, v, _per_folded_row(visible, hq // k.shape[1]), scale)
    return out.reshape(b, hq, lq, v.shape[-1]), lse.reshape(b, hq, lq)


def fused_masked_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``fused_masked_attn``'s block, given the final ``out`` and ``lse``."""
    hkv = k.shape[1]
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _fold_groups(dout, hkv).contiguous(),
        _fold_groups(q, hkv),
        k,
        v,
        _fold_groups(out, hkv),
        lse.reshape(lse.shape[0], hkv, -1),
        0.0,
        False,
        attn_mask=_bias(visible.repeat(q.shape[1] // hkv, 1), q.dtype),
        scale=scale,
    )
    return dq.reshape(q.shape), dk, dv
