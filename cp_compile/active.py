"""The plans in force: ``with plan:`` makes a plan active (``active_plan``) for integrations that a framework
calls without the plan in their arguments, keeps what they need in force while any plan is (``while_active``), and
marks the tensors a plan made (``made_by``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Optional

from torch import Tensor

# a plan is a ``plan.ContextParallel``, which imports this module: named ``Any`` here
ContextParallel = Any

# what integrations keep in force while any plan is active: context-manager factories, entered by the
# outermost ``with plan:`` (``while_active``); filled when an integration is imported
_WHILE_ACTIVE: list[Callable[[], AbstractContextManager]] = []


class _Entered(NamedTuple):
    """One ``with plan:`` in force. The outermost also holds what the integrations keep in force while any plan is
    (``kept``) and the per-call records their factories yielded (``records``): what those integrations need between
    the calls a framework makes inside the block, gone with it."""

    plan: ContextParallel
    guard: Any
    kept: Optional[contextlib.ExitStack] = None
    records: tuple = ()


# each ``with plan:`` in force, innermost last: the one context the API keeps. Integrations called by a framework
# without the plan in their arguments (``cp_compile.hf``) read it through ``active_plan`` and ``record``.
_ACTIVE: list[_Entered] = []


def while_active(factory: Callable[[], AbstractContextManager]) -> Callable[[], AbstractContextManager]:
    """Registers ``factory``: the outermost ``with plan:`` enters ``factory()`` and leaves it at its exit.

    The extension point of integrations that must watch what runs inside a plan (``cp_compile.hf``
    installs module hooks there, so that nothing of it runs outside every plan)."""
    _WHILE_ACTIVE.append(factory)
    return factory


def active_plan() -> Optional[ContextParallel]:
    """The innermost plan entered with ``with plan:`` (None outside every one).

    Integrations that call attention through a framework's dispatch (``cp_compile.hf``)
    read it to know that the model runs under CP; under ``torch.compile`` it is read
    while tracing, so Dynamo guards on it and entering or leaving a plan recompiles.
    """
    return _ACTIVE[-1].plan if _ACTIVE else None


def record(kind: type) -> Optional[Any]:
    """The record of type ``kind`` that a ``while_active`` factory yielded for the plans now in force (None outside
    every plan): where an integration keeps what lives as long as the outermost ``with plan:`` (the model calls in
    flight). Made afresh for each outermost block."""
    if not _ACTIVE:
        return None
    return next((r for r in _ACTIVE[0].records if isinstance(r, kind)), None)


class Made(NamedTuple):
    """What a plan's ``shard`` or ``positions`` made a tensor for."""

    plan: ContextParallel
    what: str  # "shard" | "positions"
    documents: Optional[tuple[int, ...]]  # the packed batch's global cu_seqlens; None: one sequence per row


def made_by(t) -> Optional[Made]:
    """What made ``t`` when it, or the tensor it is a view of, is what a plan's ``shard`` or ``positions``
    returned; None otherwise (and for copies: ``.to()`` makes a tensor of its own). Integrations read it to
    tell a plan's shards from whole sequences, and the batch they were made for."""
    for x in (t, getattr(t, "_base", None)):
        mark = getattr(x, "_cp_compile_made_by", None) if isinstance(x, Tensor) else None
        if mark is not None:
            return mark
    return None


def made(plan: ContextParallel, t: Tensor, what: str, documents: Optional[list[int]] = None) -> Tensor:
    if t._base is not None:  # a view: views of it would name its base, not it
        t = t.clone()
    mark = Made(plan, what, None if documents is None else tuple(documents))
    setattr(t, "_cp_compile_made_by", mark)  # noqa: B010  (an attribute Tensor does not declare)
    return t


def enter(plan: ContextParallel, guard) -> None:
    """``with plan:`` (``ContextParallel.__enter__``), with the guard it arms (entered here)."""
    kept, records = None, ()
    if not _ACTIVE:
        kept = contextlib.ExitStack()
        records = tuple(kept.enter_context(factory()) for factory in _WHILE_ACTIVE)
    guard.__enter__()
    _ACTIVE.append(_Entered(plan, guard, kept, records))


def leave(plan: ContextParallel, *exc) -> None:
    """The end of ``with plan:``: the innermost entry of ``plan`` leaves."""
    for i in range(len(_ACTIVE) - 1, -1, -1):  # innermost first
        if _ACTIVE[i].plan is plan:
            entered = _ACTIVE.pop(i)
            entered.guard.__exit__(*exc)
            if entered.kept is not None:
                if _ACTIVE:  # an outer block left before an inner one: the inner keeps what was in force
                    _ACTIVE[0] = _ACTIVE[0]._replace(kept=entered.kept, records=entered.records)
                else:
                    entered.kept.close()
            break
