"""What a kind of attention is (``Kind``), the registry of kinds, and where a call's tokens come from (``Units``).

A kind (dense SDPA, FlexAttention masks, packed documents) says, for the
queries and keys a schedule puts side by side, what is visible and how to
compute a partial (out, lse) and its backward; how its tensors are gathered;
and what every rank must agree on before the first transfer. Schedules
(``cp_compile.schedules``) never look inside a kind: they move tensors and call
``cp::attend`` / ``cp::attend_backward`` (``kinds.attend``) with the kind's name, and the op hands
the call to the kind registered under it (``register_kind``).

Which tokens a call holds. Every schedule is a ring over units: the group's C
ranks form R = C / A units of A consecutive ranks (A is ``a2a_size``; rank r
is in unit r // A and, when A > 1, holds head block r % A of the A-way head
sharding). The queries are the tokens of this rank's unit; the keys are

- ``step >= 0``: unit (r // A - step) mod R's tokens. The ring is A = 1,
  steps 0..C-1; the hybrid is A = the all-to-all size, steps 0..R-1;
- ``WHOLE``: every rank's tokens, as the queries (Ulysses: A = C, one unit);
- ``GATHERED``: every rank's tokens, the queries being this rank's (A = 1).

A unit's tokens sit in the order the kind asked for (``Kind.rank_order`` for
the head exchange, ``Kind.gather`` for the all-gather). The rank is read at
run time inside the op, so a traced schedule holds the step and the unit
size, never the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..comm.gather import gather_sequence, scatter_sequence
from ..comm.groups import resolve_group
from ..kernels.merge import acc_dtype
from ..layout import layout_named
from .call import SETTINGS, Call, Settings

GATHERED = -1
WHOLE = -2


def check_heads_and_lengths(q: Tensor, k: Tensor, enable_gqa: bool) -> None:
    """[B, H, S_local, D] shards: as many q as k/v heads unless grouped-query, and one local length."""
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"q has {q.shape[1]} heads but k/v have {k.shape[1]}; pass enable_gqa=True for grouped-query attention"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"local q and k/v lengths differ ({q.shape[2]} vs {k.shape[2]}); CP shards them alike")


@dataclass(frozen=True)
class Units:
    """Where a call's queries and keys come from, on this rank (see the module docstring)."""

    rank: int
    world_size: int
    a2a: int  # ranks per unit
    step: int

    @property
    def count(self) -> int:
        return self.world_size // self.a2a

    @property
    def q_unit(self) -> int:
        return self.rank // self.a2a

    @property
    def k_unit(self) -> int:
        return (self.q_unit - self.step) % self.count

    @property
    def head_block(self) -> int:
        return self.rank % self.a2a

    @property
    def gathered(self) -> bool:
        return self.step == GATHERED


def units_at(group_name: str, a2a_size: int, step: int) -> Units:
    group = resolve_group(group_name)
    size = group.size()
    if step == WHOLE:
        return Units(group.rank(), size, size, 0)
    return Units(group.rank(), size, a2a_size, step)


class Kind:
    """One kind of attention. Subclass it, fill in the kernels, ``register_kind`` an instance."""

    name: str = ""
    settings: Optional[type[Settings]] = None  # the type of ``Call.settings`` its calls carry, if any
    # the ring's backward may run a step in two K/V-head halves (no kernel reads a head index)
    split_heads: bool = True
    # the head exchange keeps every rank's tokens in rank order (a mask evaluated at known
    # slots needs no sequence order)
    rank_order: bool = False

    def attend(self, q: Tensor, k: Tensor, v: Tensor, extra: list, units: Units, call: Call):
        """(out, lse) of the queries over the keys ``units`` names; rows that see nothing: 0, -inf."""
        raise NotImplementedError

    def attend_backward(self, dout, q, k, v, out, lse, dlse, extra: list, units: Units, call: Call):
        """(dq, dk, dv) of the same tile, given the final out and lse; dtype as ``grads_like``."""
        raise NotImplementedError

    def grads_like(self, q: Tensor, k: Tensor, v: Tensor, step: int) -> tuple:
        """Uninitialised gradients as ``attend_backward`` returns them (default: accumulator dtype)."""
        return tuple(t.new_empty(t.shape, dtype=acc_dtype(q.dtype)) for t in (q, k, v))

    def agreed(self, call: Call) -> str:
        """The settings every rank must pass alike (per-process names left out)."""
        return call.options

    def check(self, q: Tensor, k: Tensor, v: Tensor, call: Call, world_size: int, enable_gqa: bool) -> None:
        """Local checks of the sequence shards; identical inputs give identical verdicts on every rank."""

    def agree_extra(self, q: Tensor, extra: list, call: Call) -> None:
        """Collectives that make every rank agree on the kind's own tensors (run by ``start``)."""

    def start(self, q, k, v, extra: list, call: Call, world_size: int, enable_gqa: bool, what: str) -> None:
        """Before any transfer: every rank checks every rank's inputs (the same collectives everywhere)."""
        if world_size > 1:
            torch.ops.cp.agree(q, k, v, call.group_name, f"{what} kind={self.name} {self.agreed(call)}")
            self.agree_extra(q, extra, call)
        self.check(q, k, v, call, world_size, enable_gqa)

    def gather(self, t: Tensor, extra: list, call: Call, world_size: int) -> Tensor:
        """Every rank's K (or V) in the order ``attend`` reads at ``GATHERED``."""
        return gather_sequence(t, call.group_name, world_size, self.chunk_order(call, world_size))

    def scatter(self, t: Tensor, extra: list, call: Call, world_size: int) -> Tensor:
        """The inverse of ``gather`` for gradients: summed over ranks, this rank's shard."""
        return scatter_sequence(t, call.group_name, world_size, self.chunk_order(call, world_size))

    def chunk_order(self, call: Call, world_size: int) -> Optional[list[int]]:
        """Where each global chunk lies among ``world_size`` ranks' shards, concatenated in rank order, for the
        gathers and exchanges to put them in sequence order; None: the kind keeps rank order."""
        return None if self.rank_order else layout_named(call.layout).gathered_order(world_size)


KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    if kind.settings is not None:
        SETTINGS[kind.name] = kind.settings
    return kind


def kind_entry(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown attention kind {name!r}; expected one of {sorted(KINDS)}")
    return KINDS[name]
