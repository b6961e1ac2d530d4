"""The ``cp`` torch.library namespace. Importing this package registers every op."""

from . import block, comm, ring, triton_merge  # noqa: F401  (registration; .merge below)
from .block import block_attn, block_attn_backward
from .comm import count_traffic, ring_shift
from .merge import merge
from .ring import ring_attention, ring_backward, ring_forward
from . import hybrid, ulysses  # noqa: F401,E402  (registers cp::ulysses_attention, cp::hybrid_attention)

__all__ = [
    "block_attn", "block_attn_backward", "count_traffic", "merge", "ring_attention",
    "ring_backward", "ring_forward", "ring_shift",
]
