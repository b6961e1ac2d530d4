"""transformers' indexed sparse attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA, HY-v4, AXK2, dots3) under a plan.

Each family's attention module calls its indexer module, ``indexer(hidden_states, q_resid, position_embeddings,
attention_mask, position_ids, cache=cache)``, which scores the queries against the index keys that
``cache.update_indexer`` returns (its own keys, without a cache), masks the scores with ``attention_mask`` and
returns the top k of every query. The attention module then hands those indices to the attention function
(``indices=``), which for ``"cp_compile"`` attends each query to the keys it chose
(``mixers.indexed.indexed_attention``).

Under a plan, a forward pre-hook on each indexer module (torch's per-module hooks, put on a model's indexers
before its first call followed under a plan) changes two of the call's arguments, and the indexer's own code
runs unchanged:

- over a shard (training, a sharded prefill): ``cache`` becomes ``EveryRanksIndexKeys``, whose
  ``update_indexer`` returns every rank's keys in global order (and stores them in a ``ShardedCache``'s layer),
  and ``attention_mask`` the global positions' mask of this rank's queries (``VisibleKeys``): the top k are then
  global places, the one-process indices. Where the family names the indexer's rotary function
  (``Family.indexer_rope``: every DSA family), a forward of ours on the instance scores the queries by blocks of
  rows with the class's operations, each block's mask built from its rows alone, rather than the class's ``[B, L,
  heads, T]`` scores at once;
- over the same tokens on every rank (decoding): the ``ShardedCache`` layer keeps every token's index keys, and
  ``attention_mask`` becomes the causal mask of the new tokens against them.

With a ``ShardedCache`` (a sharded prefill, decoding), the indexer scores every row of the layer's preallocated
buffer of index keys, the rows not yet written hidden as later tokens, as transformers' ``StaticCache`` has it: one
process with a static cache of the same length picks the same tokens, ties included.

Everything else of the indexer's call reaches it as the attention module made it (its mask under a plan is the
``MaskSpec`` of the layer, which the module slices and passes on).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..active import active_plan
from ..kernels.sparse import row_blocks
from ..mixers import Sharding
from ..mixers.gathered import _real
from ..mixers.indexed import gather_index_keys, indexer_mask, sequence_slots, visible_keys
from .cache import ShardedCache
from .families import family_of
from .forward import plan_of_shards, sharding_of
from .gathered import _by_name
from .own_forwards import modeling_of


class EveryRanksIndexKeys:
    """Stands for the cache in an indexer's call over a shard: ``update_indexer`` returns every rank's index keys of
    the sequence in global order, padding dropped, and stores them in the ``ShardedCache`` of a sharded prefill."""

    def __init__(self, sharding: Sharding, cache: Optional[ShardedCache]):
        self.sharding, self.cache = sharding, cache

    def update_indexer(self, keys: Tensor, layer_idx: int) -> Tensor:
        every = gather_index_keys(keys, self.sharding)
        return every if self.cache is None else self.cache.update_indexer(every, layer_idx)


class VisibleKeys(NamedTuple):
    """The indexer's mask over a shard, row by row, for an indexer scored by blocks of rows (``Family.indexer_rope``;
    any other gets ``mixers.indexed.indexer_mask``, every row at once): the queries at ``places [L]`` against ``keys``
    tokens of the global sequence, within their documents (``cu_seqlens``)."""

    places: Tensor
    keys: int
    cu_seqlens: Optional[Tensor]

    def rows(self, block: slice, keys: int) -> Tensor:
        """``[rows, keys]`` bool: the mask of the queries of ``block`` over the sequence's first ``keys`` tokens."""
        return visible_keys(self.places[block], keys, self.cu_seqlens)

    def reach(self, blocks: list[slice]) -> list[int]:
        """How many leading tokens of the sequence each block's queries may see at most (one host read); traced,
        every token, which keeps the trace free of data-dependent shapes."""
        if torch.compiler.is_compiling():
            return [self.keys] * len(blocks)
        furthest = torch.stack([self.places[block].max() for block in blocks])
        return (furthest + 1).clamp(min=0).tolist()


def _before(module, args: tuple, kwargs: dict):
    plan = active_plan()
    if plan is None:
        return None
    kwargs = _by_name(module, args, kwargs)
    cache = kwargs.get("cache")
    cache = cache if isinstance(cache, ShardedCache) else None
    hidden = kwargs["hidden_states"]
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if plan_of_shards() is not None:
        sharding = sharding_of(plan, None)
        kwargs["cache"] = EveryRanksIndexKeys(sharding, cache)
        keys = _real(hidden.shape[1], sharding) if layer is None else layer.max_tokens
        if family_of(module).indexer_rope is None:
            kwargs["attention_mask"] = indexer_mask(hidden, keys, sharding)
        else:
            kwargs["attention_mask"] = VisibleKeys(sequence_slots(hidden, *sharding.op_args), keys, sharding.cu_seqlens)
    else:
        count = hidden.shape[1]
        new = torch.arange(count, device=hidden.device)
        if layer is None:
            places, rows = new, count
        else:  # a compiled step knows the rows held from the device alone
            before = layer.indexed_count if torch.compiler.is_compiling() else layer.indexed()
            places, rows = before + new, layer.max_tokens
        kwargs["attention_mask"] = visible_keys(places, rows, None)[None].expand(hidden.shape[0], -1, -1)
    return (), kwargs


def _scoring_inputs(module, hidden_states, q_resid, position_embeddings, cache) -> tuple:
    """The indexer's queries ``[B, L, heads, D]``, every rank's keys ``[B, D, T]``, the heads' weights ``[B, L,
    heads]`` (float) and the scale of the scores (None: taken into the weights), by the family's code of the indexer:
    DeepSeek-V3.2's (``Family.indexer_rope`` its rotary function) or HY-v4's (``Family.indexer_rotary_last``)."""
    family = family_of(module)
    rope = getattr(modeling_of(module), family.indexer_rope)
    batch, length, _ = hidden_states.shape
    split, rotary = [module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim], 0
    keys = module.wk(hidden_states)
    if family.indexer_rotary_last:
        split, rotary = split[::-1], -1
        keys = module.k_norm(keys.to(module.k_norm.weight.dtype)).to(hidden_states.dtype)
    else:
        keys = module.k_norm(keys)
    q_parts = list(module.wq_b(q_resid).view(batch, length, module.n_heads, module.head_dim).split(split, dim=-1))
    k_parts = list(keys.unsqueeze(2).split(split, dim=-1))
    q_parts[rotary], k_parts[rotary] = rope(q_parts[rotary], k_parts[rotary], *position_embeddings, unsqueeze_dim=2)
    keys = cache.update_indexer(torch.cat(k_parts, dim=-1).squeeze(2), module.layer_idx)
    queries, keys = torch.cat(q_parts, dim=-1).float(), keys.transpose(-1, -2).float()
    weights = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype)).float() * module.n_heads**-0.5
    if family.indexer_rotary_last:
        return queries, keys, weights * module.softmax_scale, None
    return queries, keys, weights, module.softmax_scale


@torch.no_grad()
def _top_k_by_rows(
    module, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None
) -> Tensor:
    """The indexer's forward (``_scoring_inputs``: the family's code of it) where its mask is a shard's
    ``VisibleKeys``: the scores of a block of query rows against every key at a time, ``[B, rows, heads, T]``
    (``kernels.sparse.row_blocks``), where the class's code holds the whole shard's ``[B, L, heads, T]``. Each row's
    scores are the class's dot products, scaled, rectified, weighted and masked as the class does; a block's
    products are one matmul where the class's broadcasts (other BLAS kernels: the same bits for most shapes, a few
    units in the last place apart for some, which moves a pick only at a near-tie of that size), so its top k are
    the class's. Any other call: the class's forward."""
    if not isinstance(attention_mask, VisibleKeys):
        return type(module).forward(
            module, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache
        )
    queries, keys, weights, scale = _scoring_inputs(module, hidden_states, q_resid, position_embeddings, cache)
    batch, length = hidden_states.shape[:2]
    heads, total = module.n_heads, keys.shape[-1]
    top = min(module.index_topk, total)
    picks, blocks = [], row_blocks(length, batch * heads * total)
    # One buffer for every block's scores and one for its index scores, the class's operations in place in them: a
    # fresh block for each operation costs its page faults, as much as the operation itself on a CPU. A block's
    # queries and heads are the rows of one matmul against the keys: the class's matmul broadcasts the keys over
    # the rows, a batch of [heads, D] @ [D, T] products that re-reads the transposed keys for each row. The keys
    # after the furthest a block's rows may see are not scored: the class masks them to -inf, as they are left here,
    # so every row that ``topk`` reads is the class's, whole, and ties break as they do on one process.
    most = blocks[0].stop - blocks[0].start
    held, rows_scores = queries.new_empty(batch * most * heads * total), queries.new_empty(batch * most * total)
    for rows, seen in zip(blocks, attention_mask.reach(blocks)):
        count = rows.stop - rows.start
        index_scores = rows_scores[: batch * count * total].view(batch, count, total)
        index_scores[..., seen:] = float("-inf")
        if seen:
            scores = held[: batch * count * heads * seen].view(batch, count * heads, seen)
            torch.matmul(queries[:, rows].flatten(1, 2), keys[..., :seen], out=scores)
            scores = scores.view(batch, count, heads, seen)
            scores = (scores if scale is None else scores.mul_(scale)).relu_()
            summed = torch.matmul(weights[:, rows].unsqueeze(-2), scores).squeeze(-2)
            index_scores[..., :seen] = summed.masked_fill_(~attention_mask.rows(rows, seen), float("-inf"))
        picks.append(index_scores.topk(top, dim=-1).indices.to(torch.int32))
    return torch.cat(picks, dim=1)


def hook_indexers(model) -> None:
    """Puts the pre-hook on every indexer module of ``model`` (``Family.indexer``), and where the family's indexer is
    scored by blocks of rows (``Family.indexer_rope``), that forward on the instance."""
    for module in model.modules():
        if family_of(module).indexer == type(module).__name__:
            module.register_forward_pre_hook(_before, with_kwargs=True)
            if family_of(module).indexer_rope is not None and "forward" not in module.__dict__:
                # a partial of a module-level function: a deep copy of the model gets its own
                module.forward = functools.partial(_top_k_by_rows, module)


__all__ = ["EveryRanksIndexKeys", "hook_indexers"]
