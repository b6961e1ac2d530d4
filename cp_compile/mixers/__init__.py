"""Token mixers that are not attention, under context parallelism: short causal convolutions and linear
recurrences (Gated DeltaNet, Mamba2's SSD), exact against one process.

Each function takes this rank's shard and the implementation the model would call on one process (a fused
kernel, or transformers' torch body), and calls that implementation unmodified on exchanged tensors:

- ``causal_conv1d``: the k-1 tokens before each chunk of the shard put in front of it (``halo``: one
  all-gather of every chunk's last k-1 tokens), the convolution run over the extended tensor, the halo's
  outputs dropped;
- ``gated_delta_rule`` and ``mamba2_scan``: an all-to-all from sequence sharding to head sharding, the scan
  over the whole sequence for this rank's heads, an all-to-all back (``heads``). Heads that C does not
  divide are padded with zero heads, which leave every real head's result as it is.

``Sharding`` says how the tokens are spread: the group (its name and size), the layout, and the global
``cu_seqlens`` of packed documents (the per-document layout) or None.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class Sharding(NamedTuple):
    group_name: str
    world_size: int  # the group's size, known where the call is made (read here, it stays out of a trace)
    layout: str  # "zigzag" or "contiguous"; with cu_seqlens, the per-document layout of packed documents
    cu_seqlens: Optional[Tensor] = None  # global document offsets of packed documents

    @property
    def op_args(self) -> tuple:
        """What the mixer ops take: the group's name, the layout, the documents."""
        return self.group_name, self.layout, self.cu_seqlens

    def agree(self, mixer: str, inputs: tuple[Tensor, Tensor, Tensor], settings: str = "") -> None:
        """Before a mixer's first transfer: every rank passed alike shapes and dtypes of three of its inputs, the
        same ``settings`` and documents, or every rank raises the same ValueError (a rank with another local
        length would otherwise exchange halos or heads that do not fit, or wait forever)."""
        if self.world_size == 1:
            return
        torch.ops.cp.agree(*inputs, self.group_name, f"mixer={mixer} layout={self.layout} {settings}")
        if self.cu_seqlens is not None:
            torch.ops.cp.agree_cu_seqlens(self.cu_seqlens, self.group_name)


class SideBySide(NamedTuple):
    """Runs of a stream's rows side by side in the batch, each a row of its own padded with zero rows (documents
    restarting a scan, a rank's chunks in state passing): ``rows`` ``[N, longest]``, the stream's row at each place
    (the stream's length for a zero row), and ``back`` ``[S]``, each stream row's place in the flattened
    ``[N * longest]`` (``N * longest`` for a zero row)."""

    rows: Tensor
    back: Tensor

    def split(self, t: Tensor) -> Tensor:
        """``[1, S, ...]`` -> ``[N, longest, ...]``."""
        zero = t.new_zeros(1, 1, *t.shape[2:])
        return torch.cat([t, zero], 1)[0, self.rows.to(t.device)]

    def join(self, t: Tensor) -> Tensor:
        """``[N, longest, ...]`` -> ``[1, S, ...]``."""
        flat = torch.cat([t.flatten(0, 1), t.new_zeros(1, *t.shape[2:])])
        return flat[self.back.to(t.device)][None]


__all__ = ["SideBySide", "Sharding"]
