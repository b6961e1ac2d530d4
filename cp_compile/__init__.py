"""cp_compile: context parallelism for PyTorch as custom ops and compiler passes."""

from . import registration  # noqa: F401  (first: every torch.ops.cp op, kind and schedule)
from .calibrate import calibrate
from .comm import count_traffic
from .compiler.explain import explain
from .cost.model import Machine
from .eager import (
    allgather_attention,
    cached_attention,
    flex_attention,
    hybrid_attention,
    ring_attention,
    ulysses_attention,
    varlen_attention,
)
from .errors import LocalAttentionError, UnsupportedAttention
from .kinds.flex import count_blocks
from .plan import ContextParallel, active_plan
from .sac import sac_context, sac_policy

__all__ = [
    "ContextParallel",
    "LocalAttentionError",
    "Machine",
    "UnsupportedAttention",
    "active_plan",
    "allgather_attention",
    "cached_attention",
    "calibrate",
    "count_blocks",
    "count_traffic",
    "explain",
    "flex_attention",
    "hybrid_attention",
    "ring_attention",
    "sac_context",
    "sac_policy",
    "ulysses_attention",
    "varlen_attention",
]
__version__ = "0.1.0"
