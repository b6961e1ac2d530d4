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

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0
from ..comm.groups import resolve_group
from ..kernels.masked import positions_attn
from ..kernels.merge import acc_dtype, pivot
from ..kinds.call import Settings


@dataclass(frozen=True)
class CachedSettings(Settings):
    """``cp::cached_attention``'s settings: chunked attention's chunk size and the logit soft-cap."""

    chunk: int = 0
    softcap: float = 0.0


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    group_name: str,
    left: int,
    scale: float,
    options: str,
    tag: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``q [B, Hq, Lq, D]`` (the same on every rank) at positions ``q_pos [Lq]`` against this rank's
    cache ``k [B, Hkv, L, D], v [B, Hkv, L, Dv]`` at ``k_pos [L]`` (or ``[B, Lq]`` and ``[B, L]``: each row's own
    positions, rows of different lengths); returns the attention over every
    rank's cache, (out in q's dtype, lse in the accumulator dtype), and every rank's ``tag [n]`` (in the
    accumulator dtype) as ``[C, n]``: a few numbers that ride on the collective, for checks between ranks
    that then cost no collective of their own (``inference.cache.Agreement``). Collective: every rank of
    ``group_name`` calls it with the same ``q``."""
    settings = CachedSettings.decode(options)
    out, lse = positions_attn(q, k, v, q_pos, k_pos, left, scale, chunk=settings.chunk, softcap=settings.softcap)
    return merge_over_ranks(q, out, lse, group_name, resolve_group(group_name).size(), tag)


def merge_over_ranks(
    q: Tensor, out: Tensor, lse: Tensor, group_name: str, world_size: int, tag: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Tensor]:
    """What ``cached_attention`` returns, from this rank's (out, lse) of ``q`` over its own share: one
    all-gather of every rank's, merged in rank order. Collective; ``world_size``: the group's, passed so that the
    merge traces (dynamo does not follow the lookup of a group by name)."""
    tag = lse.new_empty(0) if tag is None else tag.to(lse.dtype)
    if world_size == 1:
        return out.to(q.dtype), lse.contiguous(), tag[None].clone()
    # out, lse and the tag travel as one tensor: one collective per layer
    payload = torch.cat([torch.cat([out.to(lse.dtype), lse.unsqueeze(-1)], dim=-1).flatten(), tag])
    gathered = gather_dim0(payload[None], group_name, world_size)
    tags_at = payload.numel() - tag.numel()
    both = gathered[:, :tags_at].reshape(world_size, *out.shape[:-1], out.shape[-1] + 1)
    outs, lses = both[..., :-1], both[..., -1]
    lse = torch.logsumexp(lses, dim=0)
    out = (outs * torch.exp(lses - pivot(lse)).unsqueeze(-1)).sum(0)
    return out.to(q.dtype), lse.contiguous(), gathered[:, tags_at:].clone()


# Eager decoding calls the function above directly: a step is a few small kernels, and the custom op's own
# dispatch (schema, aliasing checks) costs as much as one of them on each layer.
cached_attention_op = torch.library.custom_op("cp::cached_attention", cached_attention, mutates_args=())


@cached_attention_op.register_fake
def _(q, k, v, q_pos, k_pos, group_name, left, scale, options, tag=None):
    dt = acc_dtype(q.dtype)
    tags = q.new_empty(resolve_group(group_name).size(), 0 if tag is None else tag.numel(), dtype=dt)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=dt), tags


def payload_numel(q: Tensor, v: Tensor) -> int:
    """Elements of what ``cp::cached_attention`` gathers from each rank for ``q`` and values ``v``, its tag aside."""
    return q[..., :1].numel() * (v.shape[-1] + 1)


torch.fx.node.has_side_effect(torch.ops.cp.cached_attention.default)  # a collective: never dropped on one rank


def check_cached_args(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape[:-1] + (k.shape[-1],):
        raise ValueError(
            f"cached attention takes [B, H, L, D] tensors; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    shared = q_pos.shape == (q.shape[2],) and k_pos.shape == (k.shape[2],)
    if not shared and (q_pos.shape != (q.shape[0], q.shape[2]) or k_pos.shape != (k.shape[0], k.shape[2])):
        raise ValueError(
            f"positions must be one per query ({q.shape[2]}) and per cache slot ({k.shape[2]}), the same for every "
            f"row or [B, L] for each row's own; got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}"
        )
    if acc_dtype(q.dtype) != acc_dtype(k.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k.dtype}")
