"""A short causal depthwise convolution over a shard: halo in front of every chunk, the unmodified
convolution, the halo's outputs dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout.runs import chunk_count
from . import Sharding
from .halo import halo, halo_rows

ConvFn = Callable[..., Tensor]  # (x [B, D, L], weight [D, k], bias, activation, **kwargs) -> [B, D, L]


def depthwise_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation=None) -> Tensor:
    """The one-process reference: ``x`` ``[B, D, L]``, ``weight`` ``[D, k]``; ``activation`` None or "silu"."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def with_halo(x: Tensor, dim: int, width: int, sharding: Sharding, reset: bool = False) -> Tensor:
    """This rank's shard ``x`` (tokens along ``dim``) with the ``width - 1`` tokens before each of its chunks put in
    front of the chunk: a causal mixer of that width run over it gives each of the shard's tokens its one-process
    value (``without_halo`` drops the rest). ``reset``: zero rows where the tokens before are another document's."""
    before = halo(x, dim, width, *sharding.op_args, reset)  # chunk after chunk
    if sharding.cu_seqlens is None:  # equal chunks: a reshape
        pieces = chunk_count(sharding.layout, sharding.world_size)
        return torch.cat([before.unflatten(dim, (pieces, width - 1)), x.unflatten(dim, (pieces, -1))], dim + 1).flatten(
            dim, dim + 1
        )
    assembly, _ = halo_rows(sharding.cu_seqlens, x.shape[dim], sharding.world_size, width)
    return torch.cat([x, before], dim).index_select(dim, assembly)


def without_halo(out: Tensor, dim: int, width: int, sharding: Sharding, local_len: int) -> Tensor:
    """The shard's own rows of a mixer's output over ``with_halo``'s tensor."""
    if sharding.cu_seqlens is None:
        pieces = chunk_count(sharding.layout, sharding.world_size)
        return out.unflatten(dim, (pieces, -1)).narrow(dim + 1, width - 1, local_len // pieces).flatten(dim, dim + 1)
    _, keep = halo_rows(sharding.cu_seqlens, local_len, sharding.world_size, width)
    return out.index_select(dim, keep)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    activation: Optional[str],
    sharding: Sharding,
    *,
    conv: ConvFn = depthwise_causal_conv1d,
    reset: bool = False,
    **kwargs,
) -> Tensor:
    """``conv(x, weight, bias, activation, **kwargs)`` of this rank's shard ``x`` (``[B, D, L]``, tokens last) as
    one process computes it over the whole sequence.

    ``reset``: the convolution restarts at each document of ``sharding.cu_seqlens`` (a kernel given
    ``seq_idx`` does); without it, tokens of the previous document are read as one process reads them."""
    width, dim = weight.shape[-1], x.dim() - 1
    sharding.agree("causal_conv1d", (x, weight, x), f"activation={activation} reset={reset}")
    extended = with_halo(x, dim, width, sharding, reset)
    return without_halo(conv(extended, weight, bias, activation, **kwargs), dim, width, sharding, x.shape[dim])


__all__ = ["causal_conv1d", "depthwise_causal_conv1d", "with_halo", "without_halo"]
