"""Kernels: one dense tile (``block``), the online-softmax merge (``merge``, fused on CUDA by
``triton_merge``), packed-document tiles (``tiles``). They know nothing of ranks or schedules."""

from . import block, merge, triton_merge  # noqa: F401  (registers cp::block_attn, cp::merge, cp::merge_, ...)
