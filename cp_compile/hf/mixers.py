"""transformers' token mixers that are not attention, under a plan: short convolutions, Gated DeltaNet / KDA,
Mamba2.

transformers' hybrid models mix tokens outside attention through module-level functions of their modeling
files, looked up by name at every call (the names its kernel hub swaps for fused kernels):
``causal_conv1d_fn`` (every family here), ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo
hybrid, ...), ``chunk_kimi_delta_attention`` (Kimi Linear), ``mamba2_chunk_scan`` (Nemotron-H, Bamba,
Granite 4 hybrid, Zamba2, Falcon-H1, Mamba2), ``mamba_selective_scan`` (Jamba, Mamba, FalconMamba) and the
fused ``mamba2_split_conv1d_scan_combined`` and ``mamba_inner_fn``.

When a plan is entered (and at a model's first call under one), each such function of a covered family's modeling
module (``families.Family.wrapped``, those imported by then) is wrapped once: outside every plan the wrapper calls
the function it wraps, unchanged; inside a plan it runs it under CP (``cp_compile.mixers``), calling the wrapped
function itself (fused kernel or torch body) on exchanged tensors:

- the convolution over this rank's chunks with the halo of the tokens before each one;
- a scan over the whole sequence for this rank's head groups (all-to-all to heads and back), or state passing
  (each chunk from a zero state, one fp32 summary per chunk exchanged), as ``plan.scan_route`` says or the
  cost model picks (``cost.mixers``);
- a selective scan (Mamba1) over the whole sequence for this rank's channels (all-to-all to channels, B and C
  to every rank, and back);
- the fused Mamba paths return None, as their torch bodies do, so the mixer takes its unfused steps above.

A model of a covered family declares these layers in ``config.layer_types`` (``linear_attention``,
``conv``, ``hybrid``), which the attention's mask function accepts for it alone
(``hf.cache.runs_mixers_under_cp``). Any other
family's such layers stay refused by name; a mixer that escapes the wrappers (a function swapped after the
plan wrapped it) and runs its torch body meets the plan's guard on ``torch.conv1d``.

Packed documents: the tokens are exchanged in the layout the plan sharded them with (``cu_seq_lens_q``,
``with plan.packed(cu)``, or eagerly the model call's shard: ``forward.documents_in_force``; a model whose mixers ran
another batch than its shard's is refused when it returns, ``hf.checks``), and the mixers restart at documents
exactly where the one-process call does: a gated delta rule given ``cu_seqlens`` and a convolution or Mamba2 scan given
``seq_idx`` (what TRL's padding-free collator passes) restart there, as the fused kernels do (transformers'
torch bodies refuse them); without, they read across the boundary, as one process does.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from ..cost.mixers import ScanShape, choose_route
from ..cost.model import default_machine
from ..errors import UnsupportedAttention
from ..guard import set_aside
from ..layout.runs import chunk_count
from ..mixers import Sharding
from ..mixers.conv import causal_conv1d
from ..mixers.scan import gated_delta_rule, mamba2_scan, selective_scan
from ..plan import ContextParallel
from .families import FAMILIES
from .forward import count_call, plan_of_shards, sharding_of


def _restarts_at_documents(name: str, kwargs: dict, sharding: Sharding) -> bool:
    """Whether the model asks ``name`` to restart at documents (``seq_idx``, which a fused kernel reads and the
    torch body refuses); the documents are then the batch's global ones, which the ranks need to know."""
    if kwargs.get("seq_idx") is None:
        return False
    if sharding.cu_seqlens is None:
        raise UnsupportedAttention(
            f"{name} under context parallelism with seq_idx but no documents: call the model inside "
            "`with plan.packed(cu):` so that every rank knows where the documents start"
        )
    return True


def _conv(original):
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        plan = plan_of_shards()
        if plan is None:
            return original(hidden_states, weight, bias, activation, **kwargs)
        sharding = sharding_of(plan, kwargs.get("cu_seq_lens_q"))
        # restarting at documents, the halo holds zeros before each document's first token: the convolution of
        # the extended shard needs no seq_idx of its own (each chunk of the shard lies within one document)
        reset = _restarts_at_documents("causal_conv1d_fn", kwargs, sharding)
        count_call(convs=1)
        with set_aside():  # the torch body's conv1d runs on the extended shard, on purpose
            return causal_conv1d(hidden_states, weight, bias, activation, sharding, conv=original, reset=reset)

    return conv


def _route(plan: ContextParallel, shape: ScanShape, device) -> str:
    """The plan's scan route, or the one the cost model picks (the same on every rank: shapes, C and the plan's
    machine)."""
    if plan.scan_route != "auto":
        return plan.scan_route
    machine = plan.machine if plan.machine is not None else default_machine(device.type)
    return choose_route(shape, machine)[0].route


def _delta_rule(original):
    @functools.wraps(original)
    def delta_rule(query, key, value, g, beta, *args, **kwargs):
        plan = plan_of_shards()
        if plan is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args:
            kwargs["chunk_size"], *args = args
        if args:
            raise TypeError("pass the gated delta rule's options after chunk_size by name")
        count_call(scans=1)
        # fla's kernels restart at cu_seqlens alone; seq_idx, which some families pass on, is not theirs to read
        kwargs.pop("seq_idx", None)
        sharding = sharding_of(plan, kwargs.get("cu_seqlens"))
        b, local_len, hk, dk = key.shape
        hv, dv = value.shape[-2:]
        chunks = chunk_count(sharding.layout, plan.world_size, sharding.cu_seqlens)
        shape = ScanShape.delta_rule(
            b, local_len, plan.world_size, chunks, hk, dk, hv, dv, g[0, 0].numel(), value.element_size()
        )
        route = _route(plan, shape, value.device)
        return gated_delta_rule(original, query, key, value, g, beta, sharding, route=route, **kwargs)

    return delta_rule


def _mamba2(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        plan = plan_of_shards()
        if plan is None:
            return original(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
        if args:
            raise TypeError("pass mamba2_chunk_scan's options after chunk_size by name")
        count_call(scans=1)
        sharding = sharding_of(plan, kwargs.get("cu_seq_lens_q"))
        _restarts_at_documents("mamba2_chunk_scan", kwargs, sharding)
        b, local_len, heads, p = hidden_states.shape
        groups, n = B.shape[2], B.shape[3]
        chunks = chunk_count(sharding.layout, plan.world_size, sharding.cu_seqlens)
        shape = ScanShape.mamba2(
            b, local_len, plan.world_size, chunks, heads, p, groups, n, hidden_states.element_size()
        )
        route = _route(plan, shape, hidden_states.device)
        return mamba2_scan(original, hidden_states, dt, A, B, C, chunk_size, sharding, route=route, **kwargs)

    return scan


def _selective(original):
    @functools.wraps(original)
    def scan(hidden_states, dt, A, B, C, *args, **kwargs):
        plan = plan_of_shards()
        if plan is None:
            return original(hidden_states, dt, A, B, C, *args, **kwargs)
        if args:
            raise TypeError("pass the selective scan's options after C by name")
        count_call(scans=1)
        sharding = sharding_of(plan, kwargs.get("cu_seq_lens_q"))
        return selective_scan(original, hidden_states, dt, A, B, C, sharding, **kwargs)

    return scan


def _unfused(original):
    @functools.wraps(original)
    def fused(*args, **kwargs):
        return None if plan_of_shards() is not None else original(*args, **kwargs)

    return fused


_WRAPPERS = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _delta_rule,
    "chunk_kimi_delta_attention": _delta_rule,
    "mamba2_chunk_scan": _mamba2,
    "mamba2_split_conv1d_scan_combined": _unfused,
    "mamba_selective_scan": _selective,
    "mamba_inner_fn": _unfused,
}


def wrap_loaded_families() -> None:
    """Wraps the mixer functions of every covered modeling module imported so far (once each: a wrapper carries the
    function it wraps, and is not wrapped again)."""
    for family in FAMILIES.values():
        module = sys.modules.get(family.module) if family.wrapped else None
        if module is None:
            continue
        for function, wrapper in _WRAPPERS.items():
            original = getattr(module, function, None)
            if original is not None and not hasattr(original, "cp_compile_wraps"):
                wrapped = wrapper(original)
                wrapped.cp_compile_wraps = original
                setattr(module, function, wrapped)


@contextlib.contextmanager
def mixers_under_plans():
    """Entered with each outermost plan (``plan.while_active``): the covered families loaded by then are wrapped."""
    wrap_loaded_families()
    yield


__all__ = ["mixers_under_plans", "wrap_loaded_families"]
