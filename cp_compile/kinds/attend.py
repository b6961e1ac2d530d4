"""The per-step ops every schedule calls, for every kind: ``cp::attend`` and ``cp::attend_backward`` hand a
tile to the kind registered under the call's kind name."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.block import dense_like, result_like
from ..layout.blockmask import Mods
from ..torch_compat import node_argument
from .base import GATHERED, WHOLE, kind_entry, units_at
from .call import MODS_SCHEMA, Call

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
