"""Hugging Face transformers: ``attn_implementation="cp_compile"``, a sharded KV cache, and generation.

``import cp_compile.hf`` registers the attention and mask functions
(``attention.py``) through transformers' documented extension points; no
model code is patched. ``ShardedCache`` (``cache.py``) keeps each rank's share
of the K/V; ``generate`` (``generate.py``) runs ``model.generate`` with the
prompt prefilled sharded over the plan.
"""

from .attention import NAME, attention, mask
from .cache import ShardedCache
from .generate import generate, sharded_prefill

__all__ = ["NAME", "ShardedCache", "attention", "generate", "mask", "sharded_prefill"]
