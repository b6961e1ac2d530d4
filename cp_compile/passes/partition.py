"""Joint-graph pass: CP outputs are saved for backward, never recomputed.

Recomputing a CP op in the backward graph re-runs its whole ring (C-1 K/V
transfers) to rebuild tensors about the size of one local q. So whatever the
partitioner's policy (plain checkpoint regions,
``activation_memory_budget < 1``), the outputs of CP forward ops are marked
MUST_SAVE. The mark is made on the joint graph, which is the same on every rank,
so every rank's partitioner makes the same choice.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

CP_FORWARD_OPS = (torch.ops.cp.ring_attention.default,)


def save_cp_outputs(graph: fx.Graph) -> int:
    """Mark CP forward ops and their outputs MUST_SAVE; returns how many ops."""
    marked = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in CP_FORWARD_OPS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for user in node.users:
                if user.target == operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked
