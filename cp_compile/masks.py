"""Composable mask_mods over global token indices, for FlexAttention with or without CP.

Each builder returns a ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``;
``and_`` / ``or_`` combine them. They are written with tensor ops only, so
FlexAttention, ``create_block_mask`` and Dynamo can trace them, and they read
global positions: under CP, ``ContextParallel.shard(block_mask)`` maps local
indices to global ones before a mask_mod sees them.
"""

from __future__ import annotations

from torch import Tensor


def causal():
    """A query sees itself and every earlier key."""

    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return mask


def sliding_window(window: int):
    """Causal, and at most ``window - 1`` tokens back: each query sees ``window`` keys."""
    if window < 1:
        raise ValueError(f"sliding_window(window={window}): window must be at least 1")

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask


def document(doc_ids: Tensor):
    """Tokens attend within their own document; ``doc_ids[i]`` is token i's document (global, unsharded)."""

    def mask(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    return mask


def prefix_lm(prefix_len: int):
    """The first ``prefix_len`` tokens see each other; the rest is causal."""

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return mask


def and_(*mods):
    """Visible where every one of ``mods`` is."""

    def mask(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return mask


def or_(*mods):
    """Visible where any one of ``mods`` is."""

    def mask(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return mask
