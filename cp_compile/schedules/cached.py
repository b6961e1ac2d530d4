"""Queries every rank holds against a KV cache sharded over the ranks: the decode schedule.

Generation after a sharded prefill runs each new token on every rank (one
token's query is cheap to replicate). Every rank attends it to the cache
slots it holds, the C partial (out, lse) are all-gathered and merged in rank
order, so every rank ends with the same bits and picks the same next token.
One all-gather of ``[B, H, Lq, D + 1]`` per layer, whatever the cache length.

Key and query positions are data (cache slots carry the global position of
their token), so the op serves decode steps, multi-token steps (drafts, a
follow-up prompt) and sliding windows alike, and a compiled decode step
holds neither the rank nor the position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import resolve_group
from ..comm.gather import gather_dim0
from ..kernels.block import positions_attn
from ..kernels.merge import acc_dtype, pivot


def merge_ranks(outs: Tensor, lses: Tensor) -> Tensor:
    """Every rank's partial (out [C, ...], lse [C, ...]) merged in one fixed order."""
    return (outs * torch.exp(lses - pivot(torch.logsumexp(lses, dim=0))).unsqueeze(-1)).sum(0)


@torch.library.custom_op("cp::cached_attention", mutates_args=())
def cached_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, group_name: str,
                     left: int, scale: float) -> Tensor:
    """``q [B, Hq, Lq, D]`` (the same on every rank) at positions ``q_pos [Lq]`` against this rank's
    cache ``k, v [B, Hkv, L, D]`` at ``k_pos [L]``; returns the attention over every rank's cache.
    Collective: every rank of ``group_name`` calls it with the same ``q``."""
    out, lse = positions_attn(q, k, v, q_pos, k_pos, left, scale)
    world_size = resolve_group(group_name).size()
    if world_size > 1:  # out and lse travel as one tensor: one collective per layer
        both = gather_dim0(torch.cat([out, lse.unsqueeze(-1)], dim=-1).unsqueeze(0), group_name, world_size)
        out = merge_ranks(both[..., :-1], both[..., -1])
    return out.to(q.dtype)


@cached_attention.register_fake
def _(q, k, v, q_pos, k_pos, group_name, left, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


torch.fx.node.has_side_effect(torch.ops.cp.cached_attention.default)  # a collective: never dropped on one rank


def check_cached_args(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape[:-1] + (k.shape[-1],):
        raise ValueError(f"cached attention takes [B, H, L, D] tensors; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q_pos.shape != (q.shape[2],) or k_pos.shape != (k.shape[2],):
        raise ValueError(f"positions must be 1-D, one per query ({q.shape[2]}) and per cache slot ({k.shape[2]}); "
                         f"got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
    if acc_dtype(q.dtype) != acc_dtype(k.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k.dtype}")
