"""Partitioning: CP outputs are saved for backward, never recomputed.

Recomputing a CP op in the backward graph re-runs its whole ring (C-1 K/V
transfers) to rebuild tensors about the size of one local q. Two pieces keep
it out of every backward graph:

- ``save_cp_outputs`` (a joint-graph pass) marks CP forward ops and their
  outputs MUST_SAVE, which the partitioners honour under plain
  ``torch.utils.checkpoint`` regions and SAC policies that would recompute;
  so are the agreements (``cp::agree`` and its kin: ops with a side effect,
  which a checkpointed region may not recompute and the partitioner refuses
  there): they run once, in the forward, and the mixers' own exchanges, pure
  ops, are recomputed with the region on every rank alike;
- ``CPPartitioner`` wraps Inductor's min-cut partitioner for
  ``torch._functorch.config.activation_memory_budget < 1``, where the tags are
  not enough: a budget of 0 saves only the graph inputs whatever the tags say,
  and between 0 and 1 the knapsack may still trade a CP output away. When the
  min-cut's backward holds a CP forward op, the graph is split again from the
  same saved set plus the CP outputs.

Both act on the joint graph, which is the same on every rank, so every rank's
partitioner makes the same choice.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

from ..comm import agree  # noqa: F401  (registers the agreements' ops)
from ..schedules.registry import FORWARD_OPS as CP_FORWARD_OPS


def save_cp_outputs(graph: fx.Graph) -> int:
    """Mark CP forward ops and their outputs MUST_SAVE; returns how many ops.

    The op node itself must carry the mark: a checkpoint region tags it
    PREFER_RECOMPUTE, and only a node-level MUST_SAVE overrides that. Under an
    activation memory budget the min-cut partitioner would then save the tuple
    value itself, which no backward graph can take, so there only the outputs
    are marked (``CPPartitioner`` does the rest).
    """
    from torch._functorch import config as functorch_config

    budgeted = functorch_config.activation_memory_budget < 1.0
    marked = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _AGREEMENTS:  # run once, in the forward
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        if node.op == "call_function" and node.target in CP_FORWARD_OPS:
            if not budgeted:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for user in _cp_outputs(node):
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


# the agreements, ops with a side effect (a collective whose result is a check): never recomputed
_AGREEMENTS = (
    torch.ops.cp.agree.default,
    torch.ops.cp.agree_tensors.default,
    torch.ops.cp.agree_cu_seqlens.default,
)


def _cp_outputs(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if user.target == operator.getitem]


def recomputed_cp_ops(backward: fx.GraphModule) -> list[fx.Node]:
    return [n for n in backward.graph.nodes if n.op == "call_function" and n.target in CP_FORWARD_OPS]


def partition_saving_cp(
    joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, static_lifetime_input_indices=None, **kwargs
):
    """Min-cut partition, then, if it recomputes a CP op, the same split with the CP outputs saved."""
    from ..torch_compat import extract_forward_backward, partitioners

    P = partitioners()
    fw, bw = P.min_cut_rematerialization_partition(
        joint,
        joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
        **kwargs,
    )
    if not recomputed_cp_ops(bw):
        return fw, bw
    by_name = {n.name: n for n in joint.graph.nodes}
    saved_by_fw = list(fw.graph.output_node().args[0][num_fwd_outputs:])
    missing = [n.name for n in saved_by_fw if n.name not in by_name]
    if missing:
        raise RuntimeError(f"cp_compile: cannot map saved forward values {missing} back to the joint graph")
    saved = [by_name[n.name] for n in saved_by_fw]
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.target in CP_FORWARD_OPS:
            saved += [out for out in _cp_outputs(node) if out not in saved]
    node_info = P.classify_nodes(joint, static_lifetime_input_indices or [], num_fwd_outputs)
    fw, bw = extract_forward_backward(
        joint,
        saved,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=node_info.static_lifetime_input_nodes,
    )
    bw = P.reordering_to_mimic_autograd_engine(bw)
    return P.raise_getitems(fw), P.raise_getitems(bw)


class CPPartitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: ``partition_saving_cp``."""

    def __init__(self, key: tuple):
        self.key = key

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        return partition_saving_cp(gm, joint_inputs, **kwargs)

    def uuid(self):
        return ("cp_compile.partition", self.key)
