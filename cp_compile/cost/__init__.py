"""The cost model: which schedule a call should run, from its shapes, its mask and the machine.

A layer of its own, below the compiler passes and the eager API, which both ask it (a compiled site through
``compiler.choose``; ``cp_compile.varlen_attention`` and ``cp_compile.flex_attention`` from their tensors), as
do calibration and the benchmarks. ``model`` estimates every schedule for a dense workload on a ``Machine``;
``masked`` counts the visible tiles of packed documents, windows and BlockMasks per (query rank, key rank) and
estimates from those.
"""
