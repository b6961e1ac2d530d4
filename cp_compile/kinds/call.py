"""The one record of an attention call, from the API to the kernel: ``Call``, with its kind's typed
``Settings``, and their encoding as the custom ops' arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ..layout.blockmask import Mods
from ..torch_compat import opaque_reference_type

MODS_SCHEMA = f"{opaque_reference_type(Mods)}? mods=None"


@dataclass(frozen=True)
class Settings:
    """A kind's own settings (dense attention has none): a subclass with typed fields (ints and floats). The op
    schemas carry them as one string, ``"name=value ..."``, which ``encode`` writes and ``decode`` reads: the one
    place that string is made or parsed. Fields at their default are left out of it."""

    def encode(self) -> str:
        # the class's field table and getattr, not ``dataclasses.fields`` or ``vars(self)``: Dynamo traces this
        # (and torch 2.11's Dynamo cannot call ``items`` on a frozen dataclass's ``__dict__``)
        cls = type(self)
        return " ".join(
            f"{name}={getattr(self, name)!r}"
            for name in cls.__dataclass_fields__
            if not (hasattr(cls, name) and getattr(cls, name) == getattr(self, name))
        )

    @classmethod
    def decode(cls, options: str) -> Settings:
        items = dict(item.split("=", 1) for item in options.split())
        types = {f.name: _PARSERS[f.type] for f in fields(cls)}
        try:
            return cls(**{name: types[name](value) for name, value in items.items()})
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{options!r} are not {cls.__name__} (fields {', '.join(types)})") from None


# each kind's settings type, by kind name (``kinds.base.register_kind`` enters them)
SETTINGS: dict[str, type[Settings]] = {}
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
        settings = SETTINGS.get(kind)
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
