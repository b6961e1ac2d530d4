"""A diagonal linear recurrence, ``h_t = a_t * h_{t-1} + x_t`` per channel (RecurrentGemma's RG-LRU), by state passing.

A chunk of consecutive tokens maps the state entering it, ``S``, to ``(prod_t a_t) * S + U``, and each of its outputs to
its output from a zero state plus ``(prod_{s <= t} a_s) * S``. Each rank runs the model's own scan over each of its
chunks from a zero state (the chunks side by side in the batch: ``state._Pieces``), the ranks all-gather one summary
``(prod a, U)`` per chunk (fp32 at least), every rank folds them in sequence order (``state._entering``), and each
output adds the running product of its chunk's gates times the entering state. A reset (``a_t = 0``: the RG-LRU's
documents, where ``position_ids`` are 0) zeroes the running product there, so no chain needs restarting. The zero
tokens in front of a packed document's chunk hold ``a = 1``: they decay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from . import Sharding
from .state import _entering, _Pieces

# (x [N, l, W], a [N, l, W]) -> (h [N, l, W], the state after the last token [N, W]): the model's scan from a zero state
DiagonalScan = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def diagonal_scan_states(
    scan: DiagonalScan, x: Tensor, a: Tensor, sharding: Sharding, initial_state: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """``h`` of this rank's tokens ``x, a [B, L, W]`` (the plan's shard) over the whole sequence, in ``x``'s dtype, and
    the state after the sequence's last token (the same on every rank); ``initial_state [B, W]``: the state before
    its first."""
    b, local_len, width = x.shape
    pieces = _Pieces(sharding, local_len, b)
    x_p, a_p = pieces.split(x), pieces.split(a)
    real = pieces.real(x.device)
    if real is not None:
        a_p = torch.where(real[..., None], a_p, torch.ones_like(a_p))
    h, final = scan(x_p, a_p)
    acc = torch.promote_types(torch.promote_types(x.dtype, final.dtype), torch.float32)
    running = torch.cumprod(a_p.to(acc), dim=1)  # [B * F, l, W]: each token's gates since its chunk's start
    totals = running[:, -1].reshape(b, pieces.count, width)
    finals = final.to(acc).reshape(b, pieces.count, width)
    entering, last = _entering(totals, finals, initial_state, sharding, local_len, lambda t, state: t * state)
    h = h.to(acc) + running * entering.reshape(-1, 1, width)
    return pieces.join(h.to(x.dtype)), last


__all__ = ["diagonal_scan_states"]
