"""FlexAttention masks under CP: any mask_mod / score_mod over global indices.

A call's mods reach the ops as an argument of their own
(``layout.blockmask.Mods``, ``Call.mods``: the user's callables in an eager
call, the flex op's traced subgraphs in a compiled one; ``options`` carries
``mask=<B>x<H>``), and the tensors the mods read as the call's ``extra`` (mask
buffers first, the shard's index table leading them, then score buffers). The
index table (``layout.blockmask``) gives every
token's global position, so a tile between one unit's queries and another's
keys is the global mask and score at those positions. Every exchange and
gather keeps rank order: the table's all-ranks region is in that order. The
tiles are evaluated, and the chunk pairs with nothing visible skipped, by
``kernels.flex_tiles``; a unit's tokens are table entries [u * n, (u + 1) * n),
n = tokens per unit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.flex_tiles import MaskCall, resolve_mask_call, tile_backward, tile_forward
from ..layout.blockmask import HEADER, Mods, sharded_mask_mod
from .base import Kind, Units, check_heads_and_lengths, register_kind
from .call import Call, Settings


@dataclass(frozen=True)
class FlexSettings(Settings):
    """A flex call's BlockMask batch and head counts (1 where it broadcasts)."""

    mask_b: int = 1
    mask_h: int = 1


def _mask_call(q: Tensor, buffers: list, units: Units, call: Call) -> MaskCall:
    """The tile description for this rank's unit and heads."""
    if not isinstance(call.mods, Mods):
        raise ValueError(f"a flex call needs its mods (a cp_compile.layout.blockmask.Mods); got {call.mods!r}")
    mask_b, mask_h = call.settings.mask_b, call.settings.mask_h
    # resolve_mask_call validates the index table against the local length: a unit's tokens / its ranks
    local = q.narrow(2, 0, q.shape[2] // units.a2a)
    tile = resolve_mask_call(local, buffers, call.mods, units.world_size, call.layout, mask_b, mask_h, call.scale)
    if units.a2a == 1:
        return tile
    heads = q.shape[1]
    if mask_h not in (1, heads * units.a2a):
        raise ValueError(f"block_mask has {mask_h} heads; expected 1 or the {heads * units.a2a} query heads")
    first = units.head_block * heads
    mods = tile.mods
    mask = mods.mask
    if mask is not None and mask_h > 1:
        mask = lambda b, h, i, j, *bufs: mods.mask(b, h + first, i, j, *bufs)  # noqa: E731
    score = mods.score
    if score is not None:
        score = lambda s, b, h, i, j, *bufs: mods.score(s, b, h + first, i, j, *bufs)  # noqa: E731
    return dataclasses.replace(tile, mods=Mods(mask, score, mods.n_mask_buffers), mask_h=heads if mask_h > 1 else 1)


def _spans(q: Tensor, k: Tensor, units: Units) -> tuple[Tensor, Tensor]:
    """Table indices of the queries' and the keys' tokens."""
    n = q.shape[2]
    rows = torch.arange(units.q_unit * n, (units.q_unit + 1) * n, device=q.device)
    if units.gathered:
        return rows, torch.arange(k.shape[2], device=q.device)
    return rows, torch.arange(units.k_unit * n, (units.k_unit + 1) * n, device=q.device)


class Flex(Kind):
    name = "flex"
    settings = FlexSettings
    split_heads = False  # a score_mod may read the head index
    rank_order = True

    def attend(self, q, k, v, extra, units: Units, call: Call):
        return tile_forward(_mask_call(q, extra, units, call), q, k, v, *_spans(q, k, units))

    def attend_backward(self, dout, q, k, v, out, lse, dlse, extra, units: Units, call: Call):
        return tile_backward(_mask_call(q, extra, units, call), dout, q, k, v, out, lse, dlse, *_spans(q, k, units))

    def agreed(self, call: Call) -> str:
        return f"{call.options} layout={call.layout} scale={call.scale!r}"

    def agree_extra(self, q, extra, call: Call) -> None:
        # the mask's index table (its digest of the global mask, every rank's positions) and the tensors the
        # mods read steer which tiles run and what they mean: a rank holding another mask, or one sharded for
        # another length, would run other work. Only a rank's own positions in the table are its own.
        shared = list(extra)
        if shared and isinstance(call.mods, Mods) and call.mods.mask is not None:
            table = shared[0]
            shared[0] = torch.cat([table[:HEADER], table[HEADER + q.shape[2] :]])
        torch.ops.cp.agree_tensors(shared, call.group_name, "block_mask (or the tensors its mods read)")

    def check(self, q, k, v, call: Call, world_size: int, enable_gqa: bool) -> None:
        check_heads_and_lengths(q, k, enable_gqa)


FLEX = register_kind(Flex())


NO_MODS = Mods(None, None, 0)  # no block_mask and no score_mod: every pair visible, scores as they are


def eager_mods(block_mask, score_mod) -> tuple[Mods, list[Tensor], int, int]:
    """The call's mods: the sharded mask's own (``ShardedMaskMod.mods``) with the user's score_mod, if any, added
    (a new object: inside ``torch.compile``, a graph break); returns (mods, buffers, mask B, mask H)."""
    sharded = sharded_mask_mod(block_mask)
    if block_mask is not None and sharded is None:
        raise ValueError(
            "block_mask: this BlockMask was not sharded for CP; build it for the global sequence and pass "
            "it through ContextParallel.shard(block_mask)"
        )
    if block_mask is None:
        mods, buffers, (mask_b, mask_h) = NO_MODS, [], (1, 1)
    else:
        mods, buffers, (mask_b, mask_h) = sharded.mods, [sharded.table], block_mask.kv_num_blocks.shape[:2]
    if score_mod is not None:  # read no member of ``mods``: under Dynamo it is an opaque graph input
        mask = None if block_mask is None else (lambda b, h, i, j, *bufs: block_mask.mask_mod(b, h, i, j))
        mods = Mods(mask, lambda s, b, h, i, j, *bufs: score_mod(s, b, h, i, j), len(buffers))
    return mods, buffers, int(mask_b), int(mask_h)
