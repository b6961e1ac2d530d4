"""Attention modules of code of their own (``Family.own_attention``: BLOOM's and MPT's ALiBi, XGLM, GPT-NeoX-Japanese,
MiniMax's lightning attention), run under a plan with their projections on this rank's shard and their attention
through ``"cp_compile"``'s attention function (or, for lightning attention, by state passing: ``mixers.lightning``).

Such a module cannot hand its attention to transformers' attention interface: it multiplies queries and keys itself.
Before a model's first call under a plan (``hf.checks.prepare``), each such module's ``forward`` becomes, on the
instance, a function that runs the class's forward unchanged outside every plan, and inside one the family's forward
(``OwnAttention.forward``: the module's own projections and output layers) around ``attend`` below:

- the bias of every key (``hf.own_forwards.bias_columns``) from its global position: this rank's places in the sequence
  (``cp::sequence_slots``, the rank read at run time, so a compiled graph holds none), or, for tokens every rank holds
  (decoding), the cache's length onwards;
- queries, keys and values widened by the bias columns (``hf.own_forwards.with_bias``), the keys and values stored
  widened in the cache (a ``ShardedCache``: each rank keeps its share);
- the attention function registered as ``"cp_compile"`` (looked up in transformers' ``AttentionInterface``), which runs
  the schedules, the packed documents' kinds, or the cached attention of decoding.

Exact against one process: the same bias bits (fp32 from integer positions, as both families build theirs), added
to the same scores. MPT anchors its bias at each call's last key, and from a cache re-anchors it at every step; keys
kept in a cache are compared by later queries with keys stored by other calls, so there they all count from
position 0: one process's bias plus a constant per query (which the softmax does not see), up to fp32's rounding of
the bias.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..active import active_plan
from ..errors import UnsupportedAttention
from ..inference.rows import RowsShard
from ..mixers.gathered import gather_sequence
from ..mixers.indexed import sequence_slots
from ..mixers.lightning import lightning
from .cache import ReplicatedLinearLayer, ShardedLayer
from .families import OwnAttention, family_of
from .forward import check_recompute, count_call, plan_of_shards, sharding_of
from .mask_rows import documents_apart, mask_rows_at, mask_tensor
from .masks import NAME, MaskSpec
from .own_forwards import bias_columns, with_bias


def _shard_sharding():
    """The plan's ``Sharding`` where the tokens are a plan's shard; None elsewhere (outside every plan, decoding)."""
    plan = plan_of_shards()
    return None if plan is None else sharding_of(plan, None)


def _sharded(module):
    """``_shard_sharding()`` for a step put on ``module``: a recompute of its forward during backward outside the plan
    its forward ran in raises (it would run the class's own forward on this rank's shard alone)."""
    check_recompute(module, active_plan())
    return _shard_sharding()


def _positions(module, query: Tensor, cache, sharding) -> tuple[Tensor, object]:
    """The global positions of the call's tokens ``[L]`` and the number of keys the call attends over (``sharding``:
    ``_shard_sharding()``'s)."""
    length = query.shape[2]
    if sharding is not None:  # this rank's share of the sequence
        places = sequence_slots(query.transpose(1, 2), *sharding.op_args)
        total = length * sharding.world_size if sharding.cu_seqlens is None else sharding.cu_seqlens[-1].long()
        return places, total
    past = 0 if cache is None else cache.get_seq_length(module.layer_idx)
    return torch.arange(past, past + length, device=query.device), past + length


def _attend(
    own: OwnAttention,
    slopes: Optional[Tensor],
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask,
    cache,
    scale: float,
    dropout: float,
) -> Tensor:
    """``[B, L, H, D]``: the attention of this rank's (or every rank's) queries ``[B, H, L, D]``, with the ALiBi bias
    where the module has one."""
    value_wide = value
    if slopes is not None:
        places, total = _positions(module, query, cache, _shard_sharding())
        # from a cache, one anchor for every key it keeps: keys stored by different calls meet the same query
        anchor = total - 1 if own.anchor_last and cache is None else 0
        columns = bias_columns(slopes.to(query.device), places.to(query.device), anchor, scale, query.dtype)
        query, key, value_wide = with_bias(query, key, value, columns)
    if cache is not None:
        key, value_wide = cache.update(key, value_wide, module.layer_idx)
    out, _ = ALL_ATTENTION_FUNCTIONS[NAME](
        module,
        query,
        key,
        value_wide,
        mask,
        dropout=dropout,
        scaling=scale,
        use_cache=cache is not None,
        across_documents=own.across_documents,
    )
    return out[..., : value.shape[-1]]


def _lightning(own: OwnAttention, slopes, module, query: Tensor, key: Tensor, value: Tensor, cache) -> Tensor:
    """``[B, L, H, D]``: MiniMax's lightning attention of this rank's tokens over the whole sequence, by state passing
    (or by the all-to-all to heads: ``plan.scan_route``, and compiled on packed documents); a cache given, from the
    state it keeps, which it is left with the sequence's (the same on every rank)."""
    count_call(convs=1, scans=1)  # the module stands for its layer's mixing (``hf.checks``)
    start = None if cache is None else cache.get_linear_cache(module.layer_idx)
    sharding = _shard_sharding()  # a plan's shard: ``_forward`` runs the module's own forward for any other tokens
    route = active_plan().scan_route
    if route == "auto":  # state passing reads packed documents' tables on the host, outside a compiled graph
        route = "heads" if torch.compiler.is_compiling() and sharding.cu_seqlens is not None else "states"
    decay = module.slope_rate.reshape(-1)
    block = module.block_size
    out, last = lightning(query, key, value, decay, block, sharding, route, start, final_state=cache is not None)
    if cache is not None:
        cache.set_linear_cache(module.layer_idx, last.to(value.dtype))
        layer = cache.layers[module.layer_idx]
        if isinstance(layer, ReplicatedLinearLayer):
            layer.given_whole()
    return out


class SharedKeys(NamedTuple):
    """Decoding from a ``ShardedCache``: the layer whose share of the K/V this rank's module scores (``KeysAndRows``'
    keys), with what the module reads of every rank's keys."""

    layer: ShardedLayer
    mask: MaskSpec  # the call's
    query_places: Tensor
    like: Tensor  # the hidden states: batch, dtype, device

    def tokens(self) -> int:
        """Tokens of the sequence the layer holds over all ranks, this step's included."""
        return self.layer.stored()

    def first(self) -> int:
        """The first position of one process's row of keys for the step: every token, or, in a window, the
        ``window - 1`` before the step's (what transformers' sliding-window cache keeps) and the step's own."""
        window = self.mask.window
        past = self.tokens() - self.query_places.shape[0]
        return 0 if window is None else past - min(past, window - 1)

    def most_seen(self) -> int:
        """The most keys a query of the step sees: every token, or a window's."""
        window = self.mask.window
        return self.tokens() if window is None else min(self.tokens(), window)

    def merge(self, query: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """(out, lse) of ``query`` over every rank's keys, from this rank's over its own. Collective."""
        return self.layer.merge(query, out, lse)

    def whole(self, per_slot: Tensor, key_places: Tensor, fill) -> Tensor:
        """``[..., T]``: a value per key (``per_slot [..., S]``) of every rank, in the order and over the span of one
        process's row of keys (``first()`` on), so that a top-k over it breaks ties as one process's does.
        Collective."""
        return self.layer.every_rank_keys(per_slot, key_places, self.first(), self.tokens(), fill)

    def whole_rows(self) -> Tensor:
        """``[B, 1, n, T]``: the rows of one process's mask for the step's queries, over the keys of ``whole``."""
        first = self.first()
        return mask_tensor(self.mask, self.query_places, self.tokens() - first, None, self.like, first)

    def own_columns(self, whole: Tensor, key_places: Tensor, fill) -> Tensor:
        """``whole [..., T]`` at this rank's keys (``[..., S]``), ``fill`` at empty slots and keys before its span."""
        places = key_places - self.first()
        held = (places >= 0) & (places < whole.shape[-1])
        return whole.index_select(-1, torch.where(held, places, 0)).masked_fill(~held, fill)


class KeysAndRows(NamedTuple):
    """What a module that attends in code of its own, over every key, sees for this rank's queries (``mask_rows``)."""

    key: Tensor  # [B, H, S, D]: the keys the queries may see (every rank's, gathered; or this rank's share of a cache)
    value: Tensor
    rows: Tensor  # [B, 1, L, S]: the rows of the mask one process builds for the queries, at those keys
    query_places: Tensor  # [L] int64: the queries' global positions (-1: a padding slot)
    key_places: Tensor  # [S] int64: the keys'
    # decoding from a ``ShardedCache``: the keys are this rank's share, and the ranks' attention merges by log-sum-exp
    share: Optional[SharedKeys] = None


def _cache_layer(cache, layer: int) -> ShardedLayer:
    held = cache.layers[layer]
    if not isinstance(held, ShardedLayer) or isinstance(held, RowsShard):
        raise UnsupportedAttention(
            f"a module that scores its keys in code of its own keeps them in a ShardedCache of one sequence; layer "
            f"{layer} of the cache given is {type(held).__name__} (generate with cp_compile.hf.generate, one prompt)"
        )
    return held


def _keys_and_rows(
    own: OwnAttention,
    slopes,
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask,
    cache,
    hidden: Tensor,
    layer: Optional[int] = None,
) -> KeysAndRows:
    """``KeysAndRows`` of this rank's queries (``mask``: the call's ``MaskSpec``): for a module that builds a mask or a
    bias of its own from every key or every pair's distance (Doge's dynamic mask, Inkling's relative bias). ``layer``:
    the cache layer, where not the module's ``layer_idx`` (Inkling 2's loop)."""
    layer = module.layer_idx if layer is None else layer
    count_call(scans=1)  # the module stands for its layer's mixing (Inkling's "hybrid" layers: ``hf.checks``)
    sharding = _shard_sharding()
    if sharding is None and cache is None:  # tokens every rank holds, no cache: every rank runs the call whole
        places = torch.arange(query.shape[2], device=query.device)
        return KeysAndRows(key, value, mask_tensor(mask, places, len(places), None, hidden), places, places)
    if sharding is None:  # decoding: this rank's share of the cache, scored here and merged over the ranks
        held = _cache_layer(cache, layer)
        step = held.store(key, value)
        places, keys = step.query_positions, step.key_positions
        rows = mask_rows_at(mask, places, keys, hidden)
        return KeysAndRows(step.keys, step.values, rows, places, keys, SharedKeys(held, mask, places, hidden))
    places, total = _positions(module, query, cache, sharding)
    documents = sharding.cu_seqlens if documents_apart(mask, sharding, query.device) else None
    rows = mask_tensor(mask, places, total, documents, hidden)
    if cache is not None:  # the sharded prefill: each rank keeps its shard of the prompt's K/V
        _cache_layer(cache, layer).store(key, value)
    key, value = (gather_sequence(t, 2, sharding) for t in (key, value))
    return KeysAndRows(key, value, rows, places, torch.arange(key.shape[2], device=query.device))


def _with_picks(
    own: OwnAttention, slopes, module, query: Tensor, key: Tensor, value: Tensor, mask, scale, dropout, kwargs
) -> Tensor:
    """``[B, L, H, Dv]``: the attention function over ``key`` and ``value`` as the module made them (from what a
    ``ShardedCache``'s update returned, its step in ``kwargs``), each query over the tokens its indexer picked
    (``kwargs["indices"]``)."""
    out, _ = ALL_ATTENTION_FUNCTIONS[NAME](module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)
    return out


_MIXING = {"softmax": _attend, "lightning": _lightning, "mask_rows": _keys_and_rows, "latent": _with_picks}


def _forward(own: OwnAttention, attend, module, *args, **kwargs):
    check_recompute(module, active_plan())
    if active_plan() is None or (own.mixing == "lightning" and plan_of_shards() is None):
        # outside every plan; or tokens every rank holds, which a recurrence runs from its cache's state as one
        # process does: the class's own forward
        return type(module).forward(module, *args, **kwargs)
    return own.forward(module, attend, *args, **kwargs)


def reroute_own_attention(model) -> None:
    """Gives each module of ``model`` whose attention is its own code (``Family.own_attention``) the forward of the
    module docstring, and each whose steps are (``Family.own_steps``) those steps, once."""
    for module in model.modules():
        family, name = family_of(module), type(module).__name__
        steps = family.own_steps.get(name)
        if steps is not None and not module.__dict__.get("_cp_compile_steps"):
            steps(module, _sharded, count_call)
            module.__dict__["_cp_compile_steps"] = True
        own: Optional[OwnAttention] = family.own_attention.get(name)
        if own is None or "forward" in module.__dict__:
            continue
        attend = functools.partial(_MIXING[own.mixing], own, None if own.slopes is None else own.slopes(module))
        # partials of module-level functions, not closures: a deep copy of the model (a reference model) gets its own
        module.forward = functools.partial(_forward, own, attend, module)


__all__ = ["reroute_own_attention"]
