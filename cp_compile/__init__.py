"""cp_compile: context parallelism for PyTorch as custom ops and compiler passes.

The public surface, all importable from ``cp_compile``:

- the plan: ``ContextParallel`` (the group, the load balance, ``shard``/``unshard``/``positions``,
  ``backend()`` for ``torch.compile``, ``with plan:``) and ``active_plan``;
- eager attention over shards: ``ring_attention``, ``allgather_attention``, ``ulysses_attention``,
  ``hybrid_attention``, ``flex_attention``, ``varlen_attention`` and, for decoding against a sharded
  KV cache, ``cached_attention``;
- what a run did and what it assumes: ``explain``, ``count_traffic``, ``count_blocks``, ``Machine``,
  ``calibrate``;
- selective activation checkpointing: ``sac_policy``, ``sac_context``;
- the errors raised on purpose: ``UnsupportedAttention`` (a call CP cannot reproduce exactly) and
  ``LocalAttentionError`` (attention that would see only the local shard).

Integrations live in subpackages: ``cp_compile.hf`` (transformers models, generation, trainers) and
``cp_compile.masks`` (FlexAttention masks over global positions). ``cp_compile.tools`` holds the
commands and instruments (``python -m cp_compile ...``), which ``import cp_compile`` does not load.
"""

from . import registration  # noqa: F401  (first: every torch.ops.cp op, kind and schedule)
from .active import active_plan
from .calibrate import calibrate
from .compiler.explain import explain
from .cost.model import Machine
from .counters import count_blocks, count_traffic
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
from .plan import ContextParallel
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
