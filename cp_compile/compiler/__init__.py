"""The compiler: ``torch.compile(backend=plan.backend())`` turns attention into CP schedules.

- ``backend``: ``CPBackend``, the ``torch.compile`` backend that runs the stages below around
  AOTAutograd and hands the graphs to Inductor.
- Stage 1, on the Dynamo graph: ``rewrite`` finds attention calls through the site patterns
  (``sdpa_site``, ``flex_site``, ``varlen_site``, ``cp_site`` over ``site``) and replaces each by
  the whole op of the schedule ``choose`` picked; ``unrewritten`` marks what it left alone.
- Stage 2, on the partitioned graphs: ``partition`` keeps what the backward needs, ``expand``
  traces each whole op into its collectives and ``cp::attend`` steps, ``order`` pins their overlap.
"""
