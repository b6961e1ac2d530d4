"""What a kind of attention is, and the one per-step op pair every schedule calls.

A kind (dense SDPA, FlexAttention masks, packed documents) says, for the
queries and keys a schedule puts side by side, what is visible and how to
compute a partial (out, lse) and its backward; how its tensors are gathered;
and what every rank must agree on before the first transfer. Schedules
(``cp_compile.schedules``) never look inside a kind: they move tensors and call
``cp::attend`` / ``cp::attend_backward`` with the kind's name, and the op hands
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

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch import Tensor

from ..comm import resolve_group
from ..comm.gather import gather_sequence, scatter_sequence
from ..kernels.block import dense_like, result_like
from ..kernels.merge import acc_dtype
from ..layout.blockmask import Mods
from ..torch_compat import node_argument, opaque_reference_type

GATHERED = -1
WHOLE = -2


MODS_SCHEMA = f"{opaque_reference_type(Mods)}? mods=None"


@dataclass(frozen=True)
class Settings:
    """A kind's own settings (dense attention has none): a subclass with typed fields (ints and floats). The op
    schemas carry them as one string, ``"name=value ..."``, which ``encode`` writes and ``decode`` reads: the one
    place that string is made or parsed. Fields at their default are left out of it."""

    def encode(self) -> str:
        # the instance's own attributes and the class's defaults, not ``dataclasses.fields``: Dynamo traces this
        defaults = type(self)
        return " ".join(
            f"{name}={value!r}"
            for name, value in vars(self).items()
            if not (hasattr(defaults, name) and getattr(defaults, name) == value)
        )

    @classmethod
    def decode(cls, options: str) -> Settings:
        items = dict(item.split("=", 1) for item in options.split())
        types = {f.name: _PARSERS[f.type] for f in fields(cls)}
        try:
            return cls(**{name: types[name](value) for name, value in items.items()})
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{options!r} are not {cls.__name__} (fields {', '.join(types)})") from None


_PARSERS: dict[Any, type] = {"int": int, "float": float, int: int, float: float}  # annotations as written


@dataclass(frozen=True)
class Call:
    """One attention call's non-tensor arguments, the same on every rank.

    The one record of a call from the API to the kernel: the eager API and the compiler's insertion build it,
    ``op_args`` / ``attend_args`` encode it as the custom ops' arguments and ``from_op_args`` / ``decoded`` read it
    back, for the ops' fake and autograd implementations, the expansion of a schedule, ``cp::attend`` and the
    kinds."""

    kind: str  # the attention kind (``register_kind``): "sdpa", "flex", "packed"
    groups: tuple[str, ...]  # the schedule's group first (hybrid: the flattened mesh, ring, all-to-all)
    is_causal: bool
    layout: str  # the plan's layout of the sequence shards
    scale: float
    settings: Optional[Settings] = None  # the kind's own (``Kind.settings``), None for a kind without any
    mods: Any = None  # the flex kind's ``Mods`` (in a graph being expanded: the node that holds them)

    @property
    def group_name(self) -> str:
        return self.groups[0]

    @classmethod
    def decoded(cls, kind: str, groups: tuple, is_causal: bool, layout: str, scale: float, options: str, mods=None):
        """The call whose settings an op carries as ``options``."""
        settings = kind_entry(kind).settings
        if settings is None and options:
            raise ValueError(f"the {kind} kind takes no settings; got {options!r}")
        decoded = None if settings is None else settings.decode(options)
        return cls(kind, tuple(groups), is_causal, layout, scale, decoded, mods)

    @classmethod
    def from_op_args(cls, args: tuple, n_tensors: int) -> tuple[tuple, Call, Any]:
        """A whole op's arguments ``(*tensors, *groups, is_causal, layout, scale[, flag], kind, options[, mods])``
        as (tensors, the call, the op's own flag: ``enable_gqa`` or ``kv_heads``, None where its schema has none).
        The groups are the strings ahead of ``is_causal``."""
        tensors, rest = tuple(args[:n_tensors]), tuple(args[n_tensors:])
        n_groups = next(i for i, a in enumerate(rest) if not isinstance(a, str))
        groups, rest = rest[:n_groups], rest[n_groups:]
        if isinstance(rest[-1], str):  # the mods left at the schema's default
            rest = (*rest, None)
        is_causal, layout, scale, *flag, kind, options, mods = rest
        return tensors, cls.decoded(kind, groups, is_causal, layout, scale, options, mods), (flag[0] if flag else None)

    def op_args(self, *flag) -> tuple:
        """The call as a whole op's non-tensor arguments (the inverse of ``from_op_args``)."""
        settings = (self.is_causal, self.layout, self.scale, *flag, self.kind, self.options)
        return (*self.groups, *settings, *self._mods())

    def attend_args(self, step: int, a2a_size: int) -> tuple:
        """The non-tensor arguments of ``cp::attend`` (+ backward) for one step."""
        settings = (self.group_name, a2a_size, self.is_causal, self.layout, self.scale, self.options)
        return (self.kind, step, *settings, *self._mods())

    @property
    def options(self) -> str:
        """The settings as the ops carry them (``Settings.encode``)."""
        return "" if self.settings is None else self.settings.encode()

    def _mods(self) -> tuple:
        return () if self.mods is None else (self.mods,)


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
        return gather_sequence(t, call.group_name, world_size, self.exchange_layout(call.layout))

    def scatter(self, t: Tensor, extra: list, call: Call, world_size: int) -> Tensor:
        """The inverse of ``gather`` for gradients: summed over ranks, this rank's shard."""
        return scatter_sequence(t, call.group_name, world_size, self.exchange_layout(call.layout))

    def exchange_layout(self, layout: str) -> str:
        return "contiguous" if self.rank_order else layout


KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    return kind


def kind_entry(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown attention kind {name!r}; expected one of {sorted(KINDS)}")
    return KINDS[name]


# ----------------------------------------------------------------------------
# The per-step ops: every schedule's compute, for every kind.
# ----------------------------------------------------------------------------


_STEP_SCHEMA = (
    f"str kind, int step, str group_name, int a2a_size, bool is_causal, str layout, float scale, str options, "
    f"{MODS_SCHEMA}"
)


@torch.library.custom_op(
    "cp::attend",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor[] extra, {_STEP_SCHEMA}) -> (Tensor, Tensor)",
)
def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extra: list[Tensor],
    kind: str,
    step: int,
    group_name: str,
    a2a_size: int,
    is_causal: bool,
    layout: str,
    scale: float,
    options: str,
    mods: Optional[Mods] = None,
) -> tuple[Tensor, Tensor]:
    """The queries of this rank's unit against the keys ``step`` names: (out, lse)."""
    call = Call.decoded(kind, (group_name,), is_causal, layout, scale, options, mods)
    out, lse = kind_entry(kind).attend(q, k, v, list(extra), units_at(group_name, a2a_size, step), call)
    return out.contiguous(), lse.contiguous()


@attend.register_fake
def _(q, k, v, extra, kind, *_settings):
    kind_entry(kind)
    return result_like(q, v)


@torch.library.custom_op(
    "cp::attend_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor[] extra, "
    f"{_STEP_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)
def attend_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Optional[Tensor],
    extra: list[Tensor],
    kind: str,
    step: int,
    group_name: str,
    a2a_size: int,
    is_causal: bool,
    layout: str,
    scale: float,
    options: str,
    mods: Optional[Mods] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one ``cp::attend`` tile, each its exact share given the final out and lse.

    At ``WHOLE`` (Ulysses) they leave in the inputs' dtype: the exchange back then moves no more
    bytes than the forward's, and no accumulator-dtype copy outlives the op."""
    call = Call.decoded(kind, (group_name,), is_causal, layout, scale, options, mods)
    grads = kind_entry(kind).attend_backward(
        dout, q, k, v, out, lse, dlse, list(extra), units_at(group_name, a2a_size, step), call
    )
    if step == WHOLE:
        return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))
    return tuple(g.contiguous() for g in grads)


@attend_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, extra, kind, step, *_settings):
    if step == WHOLE:
        return dense_like(q), dense_like(k), dense_like(v)
    return kind_entry(kind).grads_like(q, k, v, step)


def listing_name(node) -> str:
    """What ``explain``'s schedule listing calls one ``cp::attend`` (+ backward) node."""
    backward = node.target is torch.ops.cp.attend_backward.default
    step = node_argument(node, "step")
    name = {GATHERED: "gathered attend", WHOLE: "heads_attend"}.get(step, "attend")
    name += "_backward" if backward else ""
    return name if step < 0 else f"{name} step={step}"
