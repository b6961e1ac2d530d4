"""The rows of the mask one process builds, for queries and keys at given global positions: what a module that reads
its attention mask as a tensor is given under a plan (over the gathered sequence, over a band of keys, over a
cache's share), from the layer's ``MaskSpec``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm.agree import every_rank
from ..comm.groups import resolve_group
from ..errors import UnsupportedAttention
from ..mixers.indexed import sees, visible_keys
from .mask_spec import MaskSpec


def mask_tensor(spec, places: Tensor, total: int, cu_seqlens, like: Tensor, first_key: int = 0) -> Tensor:
    """``[B, 1, n, total]``: the mask one process builds for queries at ``places [n]`` against the ``total`` tokens
    from ``first_key`` on (a sliding layer's cache holds its last ones alone), as the layer's ``MaskSpec`` says
    (causal, a window; within the documents of ``cu_seqlens`` when given): additive in ``like``'s dtype (0 where a
    key is visible, the dtype's minimum elsewhere), or, turned to booleans by the model (``spec.as_bool``), True where
    a key is masked. ``like [B, ...]``: the batch, dtype and device."""
    _check_causal(spec)
    keys = torch.arange(first_key, first_key + total, device=places.device)
    visible = keys[None, :] <= places[:, None] if first_key else visible_keys(places, total, cu_seqlens)
    return _as_mask(spec, visible, places, keys, like)


def mask_rows_at(spec, places: Tensor, keys: Tensor, like: Tensor, cu_seqlens=None) -> Tensor:
    """``mask_tensor`` for keys at the positions ``keys [S]`` (a cache's slots, in any order; an empty slot's position
    comes after every query's; a negative one is no token), within the documents of ``cu_seqlens`` when given."""
    _check_causal(spec)
    return _as_mask(spec, sees(places[:, None], keys[None, :], cu_seqlens) & (keys >= 0)[None, :], places, keys, like)


def _check_causal(spec) -> None:
    if not isinstance(spec, MaskSpec) or spec.chunk or not spec.causal:
        raise UnsupportedAttention(
            f"a module reading its attention mask as a tensor, over the gathered sequence: its mask ({spec!r}) is "
            "not a causal one, with or without a window, as cp_compile's mask function describes it"
        )


def _as_mask(spec, visible: Tensor, places: Tensor, keys: Tensor, like: Tensor) -> Tensor:
    if spec.window is not None:
        visible &= keys[None, :] > places[:, None] - spec.window
    if spec.as_bool:
        mask = ~visible
    else:
        mask = torch.zeros(visible.shape, dtype=like.dtype, device=like.device)
        mask = mask.masked_fill(~visible, torch.finfo(like.dtype).min)
    return mask.expand(like.shape[0], 1, *visible.shape)


def whole_sequence_mask(spec, whole: Tensor, sharding) -> Tensor:
    """``[B, 1, T, T]``: the mask one process builds for ``whole``, the gathered sequence (``[B, T, ...]``); within
    the documents of ``sharding`` where the mask function keeps documents apart, as it does when the model passes it
    the positions."""
    total = whole.shape[1]
    documents = sharding.cu_seqlens if documents_apart(spec, sharding, whole.device) else None
    return mask_tensor(spec, torch.arange(total, device=whole.device), total, documents, whole)


def documents_apart(spec, sharding, device) -> bool:
    """Whether the mask one process builds keeps the packed documents apart: where any rank's mask function saw them
    in its positions. A rank whose positions run on without a break (C = 2, documents of 4 and 12 tokens: rank 1
    holds positions 1 to 8) sees none whatever the model passes, so the ranks agree (one small all-gather); compiled,
    the spec's own answer stands (transformers keeps them apart wherever the model passes positions while tracing)."""
    seen = getattr(spec, "documents", False)
    if sharding.cu_seqlens is None or sharding.cu_seqlens.shape[0] <= 2:
        return False
    if seen is None:
        raise UnsupportedAttention(
            f"{spec.model}: compiled, a module that reads the mask tensor of a window or chunk layer, given packed "
            "documents: cp_compile cannot tell while Dynamo traces whether the model's mask keeps them apart; run it "
            "eagerly"
        )
    if sharding.world_size == 1 or torch.compiler.is_compiling():
        return seen
    return any(row[0] for row in every_rank([int(seen)], resolve_group(sharding.group_name), device))


__all__ = ["documents_apart", "mask_rows_at", "mask_tensor", "whole_sequence_mask"]
