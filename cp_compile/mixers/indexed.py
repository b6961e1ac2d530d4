"""Indexed sparse attention (DeepSeek's DSA) under context parallelism.

A light indexer scores every earlier token for each query and keeps the top k; the attention then reads those
tokens alone. Each query's top k points anywhere in the global sequence, so both halves need every rank's keys:

- the indexer: its keys (one head of ``index_head_dim`` per token) are all-gathered in global order, padding
  dropped (``gathered.gather_sequence``); each rank scores its own queries against all of them under the mask of
  global positions (``visible_keys``: causal, within the query's document) and takes the top k over the global
  sequence, which are then the indices one process takes. No gradient: the indexer runs under ``no_grad``.
- the attention (``indexed_attention``): every rank's keys and values are all-gathered the same way (the
  gradient reduce-scattered back to the rank that holds each row), and each query attends to the keys it chose
  and may see (``kernels.sparse.picked_attention``: blocks of rows, each reading its own picks where they are few
  against the keys, else scored against every key and masked to its picks; temporaries go with one block).

Bytes per layer and rank: (C-1)/C of the sequence's index keys, keys and values (the forward), and the keys' and
values' gradients back (the backward). Memory: the whole sequence's keys and values (and index keys) on every
rank while the layer runs, and the indexer's scores of this rank's queries against every key (transformers'
indexer code, unchanged: ``[B, L, index heads, T]``), 1/C of one process's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..comm.groups import resolve_group
from ..kernels.sparse import picked_attention
from . import Sharding
from .gathered import gather_sequence
from .heads import _order


@torch.library.custom_op("cp::sequence_slots", mutates_args=())
def sequence_slots(shard: Tensor, group_name: str, layout: str, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``[L]`` int64: the place in the global sequence (padding dropped) of the token in each of this rank's L slots
    (``shard``'s dim 1), -1 for a padding slot."""
    group = resolve_group(group_name)
    c, local_len = group.size(), shard.shape[1]
    order, real = _order(local_len, c, layout, cu_seqlens, shard.device)
    place = torch.where(real, torch.arange(order.numel(), device=shard.device), -1)
    by_slot = torch.empty_like(place).index_copy_(0, order, place)  # rank-major slots
    return by_slot[local_len * group.rank() : local_len * (group.rank() + 1)].clone()


@sequence_slots.register_fake
def _(shard, group_name, layout, cu_seqlens):
    return shard.new_empty(shard.shape[1], dtype=torch.int64)


_DOCUMENTS = object()  # the sharding's documents


def sees(places: Tensor, keys: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    """Whether the query at each of ``places [L, 1]`` may see the token at ``keys`` (broadcast against it): not after
    it, in its document; a padding slot (-1) sees none."""
    visible = keys <= places
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=places.device, dtype=torch.int64)
        visible &= keys >= cu[torch.searchsorted(cu, places.clamp(min=0), right=True) - 1]
    return visible


def visible_keys(places: Tensor, total: int, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``[L, total]`` bool: the tokens of the global sequence that the queries at ``places [L]`` may see (causal,
    within the query's document); a padding slot (-1) sees none."""
    return sees(places[:, None], torch.arange(total, device=places.device)[None, :], cu_seqlens)


def indexer_mask(shard: Tensor, total: int, sharding: Sharding) -> Tensor:
    """``[B, L, total]`` bool: what the indexer of this rank's queries (``shard [B, L, ...]``) may score."""
    places = sequence_slots(shard, *sharding.op_args)
    return visible_keys(places, total, sharding.cu_seqlens)[None].expand(shard.shape[0], -1, -1)


def gather_index_keys(keys: Tensor, sharding: Sharding) -> Tensor:
    """``[B, T, D]``: every rank's index keys (``keys [B, L, D]``) in global order, padding dropped."""
    return gather_sequence(keys, 1, sharding)


def indexed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    sharding: Sharding,
    scale: float,
    documents=_DOCUMENTS,
    values_in_keys: bool = False,
) -> tuple[Tensor, Tensor]:
    """``q [B, Hq, L, D]``, ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]``: this rank's queries, keys and values;
    ``indices [B, L, n]``: the global tokens each query chose (the indexer's top k; those it may not see, where
    fewer than k precede it, and negative ones are left out; so are those of another document, where ``documents``,
    by default ``sharding``'s, are given). Returns (out ``[B, Hq, L, Dv]`` in q's dtype, lse ``[B, Hq, L]`` in the
    accumulator dtype), differentiable in q, k, v; a padding slot's row is 0. ``values_in_keys``: ``v`` is the
    leading columns of ``k`` (a latent attention's, ``hf.latent``), gathered with the keys (one collective, and the
    values' gradient reaches ``k``)."""
    keys = gather_sequence(k, 2, sharding)
    values = keys[..., : v.shape[-1]] if values_in_keys else gather_sequence(v, 2, sharding)
    places = sequence_slots(q.transpose(1, 2), *sharding.op_args)
    picks = indices.long()
    usable = sees(places[:, None], picks, sharding.cu_seqlens if documents is _DOCUMENTS else documents) & (picks >= 0)
    out, lse = picked_attention(q, keys, values, picks, usable, scale)
    return out.to(q.dtype), lse


__all__ = ["gather_index_keys", "indexed_attention", "indexer_mask", "sees", "sequence_slots", "visible_keys"]
