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
  and ``attention_mask`` the global positions' mask of this rank's queries (``mixers.indexed.indexer_mask``): the top k
  are then global places, the one-process indices;
- over the same tokens on every rank (decoding): the ``ShardedCache`` layer keeps every token's index keys, and
  ``attention_mask`` becomes the causal mask of the new tokens against them.

Everything else of the indexer's call reaches it as the attention module made it (its mask under a plan is the
``MaskSpec`` of the layer, which the module slices and passes on).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..active import active_plan
from ..mixers import Sharding
from ..mixers.gathered import _real
from ..mixers.indexed import gather_index_keys, indexer_mask, visible_keys
from .cache import ShardedCache
from .families import family_of
from .forward import plan_of_shards, sharding_of
from .gathered import _by_name


class EveryRanksIndexKeys:
    """Stands for the cache in an indexer's call over a shard: ``update_indexer`` returns every rank's index keys of
    the sequence in global order, padding dropped, and stores them in the ``ShardedCache`` of a sharded prefill."""

    def __init__(self, sharding: Sharding, cache: Optional[ShardedCache]):
        self.sharding, self.cache = sharding, cache

    def update_indexer(self, keys: Tensor, layer_idx: int) -> Tensor:
        every = gather_index_keys(keys, self.sharding)
        if self.cache is not None:
            self.cache.update_indexer(every, layer_idx)
        return every


def _before(module, args: tuple, kwargs: dict):
    plan = active_plan()
    if plan is None:
        return None
    kwargs = _by_name(module, args, kwargs)
    cache = kwargs.get("cache")
    cache = cache if isinstance(cache, ShardedCache) else None
    hidden = kwargs["hidden_states"]
    if plan_of_shards() is not None:
        sharding = sharding_of(plan, None)
        kwargs["cache"] = EveryRanksIndexKeys(sharding, cache)
        kwargs["attention_mask"] = indexer_mask(hidden, _real(hidden.shape[1], sharding), sharding)
    else:
        before = cache.layers[module.layer_idx].indexed() if cache is not None else 0
        places = torch.arange(before, before + hidden.shape[1], device=hidden.device)
        kwargs["attention_mask"] = visible_keys(places, before + hidden.shape[1], None)[None].expand(
            hidden.shape[0], -1, -1
        )
    return (), kwargs


def hook_indexers(model) -> None:
    """Puts the pre-hook on every indexer module of ``model`` (``Family.indexer``)."""
    for module in model.modules():
        if family_of(module).indexer == type(module).__name__:
            module.register_forward_pre_hook(_before, with_kwargs=True)


__all__ = ["EveryRanksIndexKeys", "hook_indexers"]
