"""Communication for CP: one job per module.

- ``groups``: process groups as the ops name them and as users pass them;
- ``ring``: ``cp::ring_shift``, the ring's point-to-point hop, and its transport rules;
- ``agree``: ``cp::agree`` and friends, the agreement every call opens with;
- ``gather`` and ``exchange``: the all-gather and all-to-all layouts of a sequence, in a layout's chunk order.

What they send is counted in ``cp_compile.counters``.
"""
