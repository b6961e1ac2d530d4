"""Kernels: one dense tile (``block``), attention under an explicit visibility (``masked``: cache slots by
position, one masked call of the fused kernel), the online-softmax merge (``merge``, fused on CUDA by
``triton_merge``), packed-document tiles (``tiles``). They know nothing of ranks or schedules."""
