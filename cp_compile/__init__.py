"""cp_compile: context parallelism for PyTorch as custom ops and compiler passes."""

from . import ops  # noqa: F401  (registers torch.ops.cp.*)
from .ops.comm import count_traffic
from .ops.ring import ring_attention
from .plan import ContextParallel

__all__ = ["ContextParallel", "count_traffic", "ring_attention"]
__version__ = "0.1.0"
