"""The torch.compile backend: stage 1 on the Dynamo graph, stage 2 after partitioning.

``ContextParallel.backend(inner)`` returns a ``CPBackend``. Dynamo hands it each
captured graph; it rewrites attention into CP ops (``compiler.rewrite``), then
compiles with the inner compiler, expanding the CP ops into their schedules in
the partitioned forward and backward graphs (``compiler.expand``):

- ``inner="inductor"``: as custom post-grad passes, which carry a uuid so
  Inductor's FX graph cache stays valid (and shareable by all ranks, since the
  graphs hold no rank);
- ``inner="aot_eager"``: in the forward/backward compilers of AOTAutograd, for
  debugging without code generation.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..errors import UnsupportedAttention
from ..torch_compat import inductor_lowers_opaque_objects
from .expand import Expansion, expand_cp_ops
from .mixer_sites import MixerReport, find_mixers
from .order import pin_overlap_order, schedule_listing
from .partition import CPPartitioner, save_cp_outputs
from .rewrite import AttentionSite, rewrite_attention

INNER_COMPILERS = ("inductor", "aot_eager")


@functools.cache
def _source_hash() -> str:
    """Changes whenever the code that shapes our graphs changes (Inductor cache key)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass
class CompileRecord:
    """What the backend did to one captured graph."""

    sites: list[AttentionSite] = field(default_factory=list)
    expansions: list[Expansion] = field(default_factory=list)
    schedules: list[list[str]] = field(default_factory=list)  # per expanded graph, in final order
    mixers: list[MixerReport] = field(default_factory=list)  # convolution halos and scan exchanges


def _plan_key(plan) -> tuple:
    """What, besides the graph and our code, decides the compiled result.

    The graph holds the group's name but not its size, and the same local
    shapes at C=2 and C=4 give the same captured graph; the expansion (C ring
    steps) differs. Every cache key of ours therefore carries C (and the mesh's sizes).
    """
    settings = (plan.group_name, plan.load_balance, plan.schedule, tuple(plan.mesh_groups), plan.machine)
    return (*settings, plan.world_size, plan.mesh_sizes, _source_hash())


class _ExpandPass(CustomGraphPass):
    def __init__(self, record: CompileRecord, key: tuple):
        self.record, self.key = record, key

    def __call__(self, graph: fx.Graph) -> None:
        self.record.expansions += expand_cp_ops(graph)

    def uuid(self):
        return ("cp_compile.expand", self.key)


class _SaveCPOutputsPass(CustomGraphPass):
    def __init__(self, key: tuple):
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        save_cp_outputs(graph)

    def uuid(self):
        return ("cp_compile.save", self.key)


class _PinPass(CustomGraphPass):
    def __init__(self, record: CompileRecord, key: tuple):
        self.record, self.key = record, key

    def __call__(self, graph: fx.Graph) -> None:
        pin_overlap_order(graph)
        listing = schedule_listing(graph)
        if listing:
            self.record.schedules.append(listing)

    def uuid(self):
        return ("cp_compile.pin", self.key)


class CPBackend:
    """A ``torch.compile`` backend that turns attention into CP schedules."""

    def __init__(self, plan, inner: str = "inductor"):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"unknown inner compiler {inner!r}; expected one of {INNER_COMPILERS}")
        self.plan = plan  # the ``ContextParallel`` whose group, layout, schedule and machine the passes read
        self.inner = inner
        self.records: list[CompileRecord] = []

    def explain(self):
        """What this backend did to every graph it compiled so far, as ``cp_compile.explain`` reports it.

        For models compiled piece by piece with one backend object (e.g. each
        transformer block, as torchtitan's ``apply_compile`` does): run a step,
        then print ``backend.explain()``. Graph breaks are not counted here
        (compile with ``fullgraph=True`` to rule them out).
        """
        from .explain import ExplainReport, site_report

        world_size = self.plan.world_size
        report = ExplainReport(graphs=len(self.records))
        for record in self.records:
            report.sites += [site_report(site, world_size) for site in record.sites]
            report.schedules += record.schedules
            report.mixers += record.mixers
        return report

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        record = CompileRecord()
        compiled = self._compile(gm, example_inputs, record)
        # kept once the compile returned: Dynamo may abandon an attempt midway (it raises inside the
        # inner compiler to restart its analysis, e.g. to specialise a float) and compile the frame again
        self.records.append(record)
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs, record: CompileRecord) -> Callable:
        record.sites = rewrite_attention(gm, self.plan, example_inputs)
        record.mixers = find_mixers(gm, self.plan.world_size)
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            key = _plan_key(self.plan)
            patches = {
                "joint_custom_pre_pass": _SaveCPOutputsPass(key),
                "post_grad_custom_pre_pass": _ExpandPass(record, key),
                "post_grad_custom_post_pass": _PinPass(record, key),
                "custom_partitioner_fn": CPPartitioner(key),
            }
            if any(site.pattern == "flex" for site in record.sites):
                if not inductor_lowers_opaque_objects():
                    raise UnsupportedAttention(
                        f"FlexAttention compiled by Inductor under context parallelism needs torch 2.13 or newer "
                        f"(torch {torch.__version__}'s Inductor cannot lower the flex ops' mask and score functions); "
                        "compile with plan.backend(inner='aot_eager'), or call cp_compile.flex_attention eagerly"
                    )
                # a cache hit restores a graph's tensor constants but not its opaque objects (torch 2.13 to
                # 2.15): the flex mods would arrive as None
                patches["fx_graph_cache"] = False
            return compile_fx(gm, example_inputs, config_patches=patches)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        from ..torch_compat import partitioners

        def expand_and_run(graph_module: fx.GraphModule, _inputs):
            record.expansions += expand_cp_ops(graph_module.graph)
            listing = schedule_listing(graph_module.graph)
            if listing:
                record.schedules.append(listing)
            graph_module.recompile()
            return make_boxed_func(graph_module.forward)

        def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
            save_cp_outputs(joint.graph)
            return partitioners().default_partition(joint, joint_inputs, **kwargs)

        return aot_autograd(fw_compiler=expand_and_run, bw_compiler=expand_and_run, partition_fn=partition)(
            gm, example_inputs
        )
