"""Joint-graph pass: CP outputs are saved for backward, not recomputed.

Recomputing a CP op in the backward graph re-runs its whole ring (C-1 K/V
transfers) to rebuild tensors about the size of one local q. The outputs of CP
forward ops are therefore marked MUST_SAVE, which keeps the ring out of the
backward graph under plain ``torch.utils.checkpoint`` regions and under SAC
policies that would recompute it. The mark is made on the joint graph, which
is the same on every rank, so every rank's partitioner makes the same choice.

Not covered: ``torch._functorch.config.activation_memory_budget < 1``. The
min-cut partitioner then returns only the graph inputs for a budget of 0
(ignoring every tag), and for 0 < budget < 1 it bans recomputation only of
nodes that are themselves MUST_SAVE, which for a tuple-valued op like
``cp::ring_attention`` makes it save the tuple itself. With a budget set, CP
ops may be recomputed.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..ops.registry import FORWARD_OPS as CP_FORWARD_OPS


def save_cp_outputs(graph: fx.Graph) -> int:
    """Mark CP forward ops and their outputs MUST_SAVE; returns how many ops.

    The op node itself must carry the mark: a checkpoint region tags it
    PREFER_RECOMPUTE, and only a node-level MUST_SAVE overrides that. Under an
    activation memory budget the min-cut partitioner would then save the tuple
    value itself, which no backward graph can take, so there only the outputs
    are marked (and the op may be recomputed: see the module docstring).
    """
    from torch._functorch import config as functorch_config

    budgeted = functorch_config.activation_memory_budget < 1.0
    marked = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in CP_FORWARD_OPS:
            if not budgeted:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for user in node.users:
                if user.target == operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked
