"""Generation under CP: a KV cache sharded over the ranks and the schedule that reads it.

``cache`` places and stores each layer's sharded K/V (``CacheShard``) and agrees the
ranks' steps (``Agreement``); ``cached`` is the decode schedule (``cp::cached_attention``:
queries every rank holds against the sharded cache); ``cp_compile.hf.cache`` is the same cache as a
transformers ``Cache``.
"""
