"""cp_compile: context parallelism for PyTorch as custom ops and compiler passes."""

from . import ops  # noqa: F401  (registers torch.ops.cp.*)
from .inspect import explain
from .ops.comm import count_traffic
from .ops.flex import count_blocks, flex_attention
from .ops.ring import ring_attention
from .passes import flex_site  # noqa: F401  (registers the flex site kind)
from .passes.rewrite import UnsupportedAttention
from .plan import ContextParallel
from .sac import sac_context, sac_policy

__all__ = [
    "ContextParallel", "UnsupportedAttention", "count_blocks", "count_traffic", "explain", "flex_attention", "ring_attention", "sac_context",
    "sac_policy",
]
__version__ = "0.1.0"
