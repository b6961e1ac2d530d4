"""The ``cp`` torch.library namespace. Importing this package registers every op."""

from . import allgather, block, comm, flex, hybrid, ring, triton_merge, ulysses, varlen  # noqa: F401  (registration)
from . import ulysses_masks  # noqa: F401  (registration: the ulysses schedule of flex and varlen)
from .allgather import allgather_attention
from .block import block_attn, block_attn_backward
from .comm import count_traffic, ring_shift
from .merge import merge
from .ring import ring_attention, ring_backward, ring_forward
from .varlen import varlen_attention

__all__ = [
    "allgather_attention", "block_attn", "block_attn_backward", "count_traffic", "merge", "ring_attention",
    "ring_backward", "ring_forward", "ring_shift", "varlen_attention",
]
