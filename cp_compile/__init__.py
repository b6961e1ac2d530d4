"""cp_compile: context parallelism for PyTorch as custom ops and compiler passes."""

from . import ops  # noqa: F401  (registers torch.ops.cp.*)
from .calibrate import calibrate
from .inspect import explain
from .ops.allgather import allgather_attention
from .ops.comm import count_traffic
from .ops.flex import count_blocks, flex_attention
from .ops.ring import ring_attention
from .ops.hybrid import hybrid_attention
from .ops.ulysses import ulysses_attention
from .ops.varlen import varlen_attention
from .passes import flex_site  # noqa: F401  (registers the flex site kind)
from .passes.cost import Machine
from .passes.rewrite import UnsupportedAttention
from .plan import ContextParallel, active_plan
from .sac import sac_context, sac_policy

__all__ = [
    "ContextParallel", "Machine", "UnsupportedAttention", "active_plan", "allgather_attention", "calibrate", "count_blocks",
    "count_traffic", "explain", "flex_attention", "hybrid_attention", "ring_attention", "sac_context", "sac_policy",
    "ulysses_attention", "varlen_attention",
]
__version__ = "0.1.0"
