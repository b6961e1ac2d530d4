"""What a model's forward runs under a plan, kept for the length of the call: the record of each model call in
flight (``ModelCall``: the attention, convolution and scan calls it made, and the packed batches they ran), and what
the mixers' steps run over now (this rank's shard, or the same tokens on every rank).

The records live on ``InFlight``, which ``checks.model_call_checks`` yields for each outermost ``with plan:``
(``active.record``): nothing of a call outlives the block it ran in. The checks made of them when a model returns are
``checks.py``'s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from ..active import active_plan, made_by, record
from ..errors import LocalAttentionError, UnsupportedAttention
from ..mixers import Sharding
from ..plan import ContextParallel
from .families import family_of

_UNSEEN = object()


@dataclass
class ModelCall:
    """The outermost transformers model of an eager forward inside a plan, and what the forward ran: calls of the
    attention and mask functions, convolutions and scans run under CP, and the packed batches they ran (global
    cu_seqlens, or None: one sequence per row). ``documents``: the batch a plan's shard or positions given to the
    call were made for (``plan.shard(x, cu_seqlens=cu)``), read off the first module call inside it that is given
    one; ``_UNSEEN`` until then."""

    model: torch.nn.Module
    calls: int = 0
    convs: int = 0
    scans: int = 0
    batches: list = field(default_factory=list)
    documents: Any = _UNSEEN

    def see(self, args: tuple) -> None:
        """Reads the batch off a tensor a plan made among ``args``, given to a module inside the call (the embedding's
        ids, the rotary embedding's positions), until one is seen."""
        if self.documents is not _UNSEEN:
            return
        made = next((m for m in map(made_by, args) if m is not None), None)
        if made is not None:
            self.documents = None if made.documents is None else torch.tensor(made.documents, dtype=torch.int32)

    def documents_seen(self) -> Optional[Tensor]:
        return None if self.documents is _UNSEEN else self.documents


@dataclass
class InFlight:
    """``cp_compile.hf``'s record of the calls made inside the outermost ``with plan:``: the model calls in flight
    (innermost last), and the decoding steps of the cache layers that share their K/V with later layers (Gemma 3n's
    "store" layers), by the id of the keys their ``update`` returned: (the keys held weakly, the layer, the step)."""

    model_calls: list = field(default_factory=list)
    shared_steps: dict = field(default_factory=dict)
    # whether the latest model call that returned ran the documents its shard was made for: a checkpointed layer
    # recomputed in the backward after it has no model call to read them from
    shard_documents_ran: bool = False


def in_flight() -> Optional[InFlight]:
    """The record of the plans now in force, None outside every plan and while Dynamo traces (it holds the model
    being traced, which the graph must not read)."""
    return None if torch.compiler.is_compiling() else record(InFlight)


def _model_call() -> Optional[ModelCall]:
    calls = in_flight()
    return calls.model_calls[-1] if calls is not None and calls.model_calls else None


def documents_of_the_call() -> Optional[Tensor]:
    """The packed documents the model call in flight was given by its shard or positions (eagerly); None: one sequence
    per row, or not known (compiled, or no model call in flight)."""
    calls = in_flight()
    if calls is None:
        return None
    if calls.model_calls:
        return calls.model_calls[-1].documents_seen()
    if calls.shard_documents_ran and torch._C._current_autograd_node() is not None:
        raise UnsupportedAttention(
            "a checkpointed layer recomputes its forward during backward, after a model call that read its packed "
            "documents from its shard (plan.shard(x, cu_seqlens=cu)): no model call is in flight to say them now. "
            "Run the forward and the backward inside `with plan.packed(cu):`"
        )
    return None


def count_call(convs: int = 0, scans: int = 0) -> None:
    """Called by the attention and mask functions of ``"cp_compile"`` under a plan, and by the mixer wrappers
    with the convolutions and scans they run."""
    forward = _model_call()
    if forward is not None:
        forward.calls += 1
        forward.convs += convs
        forward.scans += scans


def ran_batch(cu_seqlens: Optional[Tensor]) -> None:
    """Called by the attention and the mixer wrappers with the documents they run (None: one sequence per row),
    checked against the shard's when the model returns."""
    forward = _model_call()
    if forward is not None and not any(cu_seqlens is seen for seen in forward.batches):
        forward.batches.append(cu_seqlens)


class _Steps:
    """What the mixers' steps run over now; an instance's attributes, not a class's, since torch 2.11's Dynamo
    cannot trace setting a class attribute. Read while Dynamo traces (the graphs of a compiled decoding step differ)."""

    def __init__(self):
        self.on_every_rank = False
        # a module runs over the gathered sequence: the attention it calls runs as on one process
        self.in_gathered_module = False


_STEPS = _Steps()


def plan_of_shards() -> Optional[ContextParallel]:
    """The active plan while the mixers are given this rank's shard of a sequence: none outside every plan, and
    none while every rank runs the same tokens (``same_tokens_on_every_rank``)."""
    return None if _STEPS.on_every_rank else active_plan()


@contextlib.contextmanager
def over_the_gathered_sequence(gathered: bool = True):
    """While a module runs over the gathered sequence (``hf.gathered``), every rank holds the same tokens: the
    mixers and the attention it calls run as on one process. ``gathered=False``: while a module inside such a module
    runs over this rank's share of a sequence of its own (``ShardedInside``), the attention it calls runs by the
    schedules again."""
    before = _STEPS.on_every_rank, _STEPS.in_gathered_module
    _STEPS.on_every_rank = _STEPS.in_gathered_module = gathered
    try:
        yield
    finally:
        _STEPS.on_every_rank, _STEPS.in_gathered_module = before


def in_gathered_module() -> bool:
    """Whether a module runs over the gathered sequence now: the masks its model code builds are one process's."""
    return _STEPS.in_gathered_module


def attention_as_one_process(module) -> bool:
    """Whether ``module``'s attention call runs as on one process under a plan: called by a module that runs over
    the gathered sequence, or over something other than the sequence."""
    return _STEPS.in_gathered_module or type(module).__name__ in family_of(module).attention_within_tokens


@contextlib.contextmanager
def same_tokens_on_every_rank(same: bool = True):
    """The steps of ``model.generate`` after a sharded prefill: every rank feeds the model the same tokens and
    holds the whole conv and recurrent state, so a mixer that runs over several tokens (a prompt of one token, a
    follow-up prompt) runs as one process runs it. ``same=False``: a step among them that runs on the shards (a
    prompt prefilled by ``generate()``'s own first call)."""
    before, _STEPS.on_every_rank = _STEPS.on_every_rank, same
    try:
        yield
    finally:
        _STEPS.on_every_rank = before


def documents_in_force(plan: ContextParallel, given: Optional[Tensor]) -> Optional[Tensor]:
    """The packed documents a call runs: those it was handed (``cu_seq_lens_q``, a kernel's ``cu_seqlens``), else those
    of ``with plan.packed(cu)``, else those the model call's shard was made for (``documents_of_the_call``); None: one
    sequence per row. Noted for the model call's check."""
    documents = given if given is not None else plan.documents
    if documents is None:
        documents = documents_of_the_call()
    ran_batch(documents)
    return documents


def sharding_of(plan: ContextParallel, cu_seqlens) -> Sharding:
    """How a mixer's tokens lie over the ranks (``documents_in_force``)."""
    documents = documents_in_force(plan, cu_seqlens)
    return Sharding(plan.group_name, plan.world_size, plan.load_balance, documents)


def check_recompute(module, plan: Optional[ContextParallel]) -> None:
    """Eagerly, a checkpointed layer recomputes its forward during backward: outside the plan or the packed
    documents (``plan.packed``) that the forward ran, it would attend to the shard alone or across the documents.
    Each module remembers what its latest forward ran under; a recompute (a forward inside backward) under
    anything else raises."""
    if torch.compiler.is_compiling():  # a compiled graph recomputes what it traced
        return
    recomputing = torch._C._current_autograd_node() is not None
    # the plan's id, not the plan: a module that holds no plan deep-copies (a plan holds its process group)
    now = None if plan is None else (id(plan), plan.documents)
    ran = module.__dict__.get("_cp_compile_ran")
    if recomputing and ran is not None and not _same_run(now, ran):
        raise LocalAttentionError(
            f"{type(module).__name__} recomputes its forward during backward (activation checkpointing) "
            "outside the `with plan:` (and `with plan.packed(cu):`) its forward ran in: the recompute would mix "
            "this rank's shard alone, or across the packed documents. Call loss.backward() inside them as well."
        )
    if not recomputing:
        module.__dict__["_cp_compile_ran"] = now  # not through nn.Module.__setattr__, which is slow


def _same_run(now, ran) -> bool:
    """The same plan and the same packed documents (by value: a block entered again for the backward makes a
    tensor of its own)."""
    if now is None or now[0] != ran[0]:
        return False
    if now[1] is None or ran[1] is None:
        return now[1] is ran[1]
    return now[1] is ran[1] or torch.equal(now[1], ran[1])


__all__ = [
    "InFlight",
    "ModelCall",
    "attention_as_one_process",
    "check_recompute",
    "count_call",
    "documents_in_force",
    "in_flight",
    "in_gathered_module",
    "over_the_gathered_sequence",
    "plan_of_shards",
    "ran_batch",
    "same_tokens_on_every_rank",
    "sharding_of",
]
