"""The cache classes that families with modules of their own require in generation under a plan
(``Family.cache``), and ``sharded_cache``, which makes the one a model's family needs.

A module that attends in code of its own and reads its K/V and mask as tensors (``Family.keeps_whole_kv``) decodes
over the whole sequence's K/V on every rank (``WholeKVCache``); one that scores its keys in code of its own, a share
of them on each rank (``ShardedCacheOfOwnAttention``); MiniMax's model takes a cache of its own class alone;
RecurrentGemma keeps its states on its modules.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

from ..mixers import Sharding
from ..mixers.gathered import gather_sequence
from .cache import (
    ReplicatedLinearLayer,
    ShardedCache,
    ShardedIndexedLayer,
    ShardedLayer,
)
from .families import family_of


def _minimax_cache_class():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class ShardedMiniMaxCache(ShardedCache, MiniMaxCache):
        """MiniMax's model takes a cache of its own class alone, and its lightning attention keeps its state through
        ``get_linear_cache`` / ``set_linear_cache``: here the state of each linear layer, whole on every rank.

        Its "full_attention" layers attend within ``config.sliding_window`` when one is set: they are kept as
        windows, and the cache is not compileable, as MiniMax's own is not, so that ``generate()`` lets the model
        build its (windowed) masks instead of building them from the layer types."""

        is_compileable = False

        def __init__(self, config, max_cache_len: int, plan=None):
            if getattr(config, "sliding_window", None) is not None:
                config = copy.copy(config)
                config.layer_types = ["sliding_attention" if t == "full_attention" else t for t in config.layer_types]
            super().__init__(config, max_cache_len, plan)

        def get_linear_cache(self, layer_idx: int):
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.has_previous_state.get(0) else None

        def set_linear_cache(self, layer_idx: int, linear_cache: Tensor) -> None:
            layer = self.layers[layer_idx]
            layer.update_recurrent_state(linear_cache, 0)
            layer.has_previous_state[0] = True

        def __len__(self) -> int:
            return len(self.layers)

    return ShardedMiniMaxCache


class ShardedCacheOfModuleStates(ShardedCache):
    """For a family whose recurrent layers keep their state on their own modules (RecurrentGemma's recurrent
    blocks): the cache's linear layers hold nothing. The sharded prefill runs those modules over the whole prompt
    (the gathered route), so each rank's modules keep the whole prompt's state; the model-call check counts them."""

    @contextlib.contextmanager
    def sharded_prefill(self, positions: Tensor, tokens: int):
        with super().sharded_prefill(positions, tokens):
            for layer in self.layers:
                if isinstance(layer, ReplicatedLinearLayer):
                    layer.pending_conv = None
            yield self


class ShardedCacheOfOwnAttention(ShardedCache):
    """For families whose attention module scores its keys in code of its own, under a mask or bias it builds over
    them (Doge's dynamic mask, Inkling's relative bias): each rank keeps its share of the K/V, as a ``ShardedCache``
    does. Decoding, each rank's module scores its share, and the ranks' partial attentions merge by log-sum-exp
    (``hf.own_attention.SharedKeys``). Decoded eagerly, one sequence at a time."""

    is_compileable = False  # a step reads how many tokens the cache holds on the host (Doge's top-k row)
    why_one_sequence = "its attention scores the cache's keys in code of its own, at the positions of one sequence"


class WholeKVLayer(DynamicLayer):
    """The whole sequence's K/V, the same on every rank: what a module that attends in code of its own reads."""

    is_compileable = False


class WholeKVIndexedLayer(DynamicIndexedLayer):
    """An indexed attention layer's whole K/V and its indexer's keys (Qwen4-exp's, whose attention module runs over
    the gathered sequence), the same on every rank. The model keeps the positions of every token it has seen on the
    layer (``indexer_position_ids``, the history its rotary embedding covers); given a shard's in a sharded prefill,
    the layer keeps the whole prompt's, gathered from every rank."""

    is_compileable = False

    def __init__(self, plan):
        self.plan, self.prompt_tokens, self._positions = plan, None, None
        super().__init__()

    @property
    def indexer_position_ids(self) -> Optional[Tensor]:
        return self._positions

    @indexer_position_ids.setter
    def indexer_position_ids(self, positions: Optional[Tensor]) -> None:
        if positions is not None and self.prompt_tokens is not None:
            prompt = torch.tensor([0, self.prompt_tokens], device=positions.device)
            sharding = Sharding(self.plan.group_name, self.plan.world_size, self.plan.load_balance, prompt)
            positions = gather_sequence(positions, positions.dim() - 1, sharding)
        self._positions = positions


class WholeKVCache(ShardedCache):
    """For families whose attention is code of their own that reads its K/V and its mask as tensors, over the gathered
    sequence (Qwen4-exp, DeepSeek-V4, CPM-Ant): every rank keeps the whole sequence's K/V, as one process does,
    C times the memory of a sharded cache. The sharded prefill runs those modules over the gathered prompt, so each
    stores the whole prompt's K/V; decoding runs them as one process does, on every rank, with no collective (the
    ranks' tokens are compared once, at the end)."""

    is_compileable = False
    keeps_whole_layers = True  # a layer type of the model's own: its own cache class, whole on every rank

    def __init__(self, config, max_cache_len: int, plan=None):
        super().__init__(config, max_cache_len, plan)
        self.layers = [self._whole(layer, self.plan) for layer in self.layers]

    @contextlib.contextmanager
    def sharded_prefill(self, positions: Tensor, tokens: int):
        indexed = [layer for layer in self.layers if isinstance(layer, WholeKVIndexedLayer)]
        for layer in indexed:
            layer.prompt_tokens = tokens
        try:
            with super().sharded_prefill(positions, tokens):
                yield self
        finally:
            for layer in indexed:
                layer.prompt_tokens = None

    @staticmethod
    def _whole(layer, plan):
        if isinstance(layer, ShardedIndexedLayer):
            return WholeKVIndexedLayer(plan)
        return WholeKVLayer() if isinstance(layer, ShardedLayer) else layer


def _family_cache_class(name: str) -> type:
    """The cache class a family's record names (``Family.cache``)."""
    if name == "ShardedMiniMaxCache":
        return _minimax_cache_class()
    return {
        "ShardedCacheOfModuleStates": ShardedCacheOfModuleStates,
        "ShardedCacheOfOwnAttention": ShardedCacheOfOwnAttention,
    }[name]


def sharded_cache(model, max_cache_len: int, plan) -> ShardedCache:
    """A new ``ShardedCache`` for ``model`` (one prompt), of the cache class its family requires where it requires
    one; a family that keeps states on its modules starts them anew, as its own call given no cache would (else a
    one-token prefill decodes from an earlier call's state)."""
    family = family_of(model)
    if family.fresh_states is not None:
        family.fresh_states(model)
    if family.keeps_whole_kv:
        return WholeKVCache(model.config, max_cache_len, plan)
    make = ShardedCache if family.cache is None else _family_cache_class(family.cache)
    return make(model.config, max_cache_len, plan)


__all__ = ["ShardedCacheOfModuleStates", "ShardedCacheOfOwnAttention", "WholeKVCache", "sharded_cache"]
