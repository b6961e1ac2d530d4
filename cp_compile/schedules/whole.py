"""A schedule as one differentiable op pair, defined once for every schedule and every kind.

Two shapes of schedule exist:

- sequence schedules (ring, all-gather): ``cp::<name>_attention(q, k, v, extra,
  group_name, is_causal, layout, scale, enable_gqa, kind, options) -> (out, lse)``;
  the forward keeps its inputs and results, the backward op takes
  ``(dout, q, k, v, out, lse, dlse, extra, group_name, is_causal, layout,
  scale, kind, options)``;
- head-sharding schedules (Ulysses, hybrid): the same arguments with one or
  more group names, returning (out, lse) plus the head-sharded (q, k, v, out,
  lse) that the backward keeps instead of the inputs; its backward op takes
  ``(dout, dlse, qh, kh, vh, out_h, lse_h, extra, *groups, is_causal, layout,
  scale, kv_heads, kind, options)``, so only dout (and dlse) in and dq, dk, dv
  out cross the all-to-all group.

``kind`` names a ``kinds.Kind``; ``extra`` are the kind's tensors (mask
buffers, ``cu_seqlens``) and ``options`` its settings. Each factory registers
the ops, their fake implementations, the autograd and the compiler expansion.

The whole ops are deliberately *not* registered side-effectful: they only
appear in graphs that are the same on every rank, so a compiler that drops an
unused one drops it everywhere, and AOTAutograd's partitioner copies
side-effectful forward nodes into the backward graph (re-running the schedule).
The ops that really talk (``cp::ring_shift``, ``cp::agree``) are side-effectful.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..comm.exchange import replicate_kv_heads
from ..comm.groups import resolve_group
from ..kernels.block import dense_like, result_like
from ..kinds.base import kind_entry
from ..kinds.call import MODS_SCHEMA, Call
from .registry import Traceable, register_schedule

_SETTINGS = "bool is_causal, str layout, float scale"
_KIND = f"str kind, str options, {MODS_SCHEMA}"


def world_size_of(group_name: str) -> int:
    return resolve_group(group_name).size()


def _distinct(tensors, inputs) -> tuple:
    """Custom op outputs may alias neither inputs nor each other (at C=1 an exchange is the identity)."""
    seen = {id(t) for t in inputs if t is not None}
    out = []
    for t in tensors:
        out.append(t.clone(memory_format=torch.contiguous_format) if id(t) in seen else t.contiguous())
        seen.add(id(out[-1]))
    return tuple(out)


def _op_pair(
    name: str,
    forward_impl: Callable,
    groups: str,
    outputs: str,
    backward_impl: Callable,
    backward_tensors_and_groups: str,
    backward_extra: str,
):
    """The custom ops ``cp::<name>_attention`` and ``cp::<name>_attention_backward``."""
    forward_op = torch.library.custom_op(
        f"cp::{name}_attention",
        forward_impl,
        mutates_args=(),
        schema=f"(Tensor q, Tensor k, Tensor v, Tensor[] extra, {groups}, {_SETTINGS}, bool enable_gqa, {_KIND}) "
        f"-> ({outputs})",
    )
    backward_op = torch.library.custom_op(
        f"cp::{name}_attention_backward",
        backward_impl,
        mutates_args=(),
        schema=f"({backward_tensors_and_groups}, {_SETTINGS}, {backward_extra}{_KIND}) -> (Tensor, Tensor, Tensor)",
    )
    return forward_op, backward_op


def _settings_count(inputs: tuple) -> int:
    """How many Nones a backward returns for the arguments after q, k, v, extra: the dispatcher hands
    autograd the arguments without a trailing default (``mods=None``)."""
    return len(inputs) - 4 - (inputs[-1] is None)


def _expansion(direction: str, impl: Callable, n_tensors: int) -> Callable[[tuple], Traceable]:
    """A whole op's expansion: its own implementation traced over its graph inputs (the tensors there are, then
    the extra tensors, then a flex call's mods), its other arguments constants of the trace."""

    def expand(args) -> Traceable:
        (*fixed, extra), call, flag = Call.from_op_args(args, n_tensors)
        present = [i for i, t in enumerate(fixed) if t is not None]  # an absent dlse stays None
        given = dataclasses.replace(call, mods=None).op_args(*(() if flag is None else (flag,)))
        mods = [] if call.mods is None else [call.mods]

        def fn(*inputs):
            tensors = list(fixed)
            for i, t in zip(present, inputs):
                tensors[i] = t
            rest = inputs[len(present) :]
            return impl(*tensors, list(rest[: len(extra)]), *given, *rest[len(extra) :])

        return Traceable(direction, world_size_of(call.group_name), fn, [*(fixed[i] for i in present), *extra, *mods])

    return expand


def _register(name: str, forward_impl: Callable, backward_impl: Callable) -> None:
    ops = torch.ops.cp
    register_schedule(
        getattr(ops, f"{name}_attention").default,
        _expansion("forward", forward_impl, 4),
        getattr(ops, f"{name}_attention_backward").default,
        _expansion("backward", backward_impl, 8),
    )


# ----------------------------------------------------------------------------
# Sequence schedules: (out, lse); the backward keeps q, k, v, out, lse.
# ----------------------------------------------------------------------------


def sequence_schedule(name: str, forward: Callable, backward: Callable):
    """Define ``cp::<name>_attention`` (+ ``_backward``) over the schedule's functions

    ``forward(q, k, v, extra, call, world_size, enable_gqa) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, dlse, extra, call, world_size) -> (dq, dk, dv)``;
    returns the forward op.
    """

    def forward_impl(*args):
        (q, k, v, extra), call, enable_gqa = Call.from_op_args(args, 4)
        out, lse = forward(q, k, v, list(extra), call, world_size_of(call.group_name), enable_gqa)
        return out.contiguous(), lse.contiguous()

    def backward_impl(*args):
        (dout, q, k, v, out, lse, dlse, extra), call, _ = Call.from_op_args(args, 8)
        grads = backward(dout, q, k, v, out, lse, dlse, list(extra), call, world_size_of(call.group_name))
        return tuple(g.contiguous() for g in grads)

    forward_op, backward_op = _op_pair(
        name,
        forward_impl,
        "str group_name",
        "Tensor, Tensor",
        backward_impl,
        "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor[] extra, "
        "str group_name",
        "",
    )

    @forward_op.register_fake
    def _(*args):
        (q, _, v, _), call, _ = Call.from_op_args(args, 4)
        kind_entry(call.kind)
        return result_like(q, v)

    @backward_op.register_fake
    def _(dout, q, k, v, out, lse, dlse, extra, *options):
        return dense_like(q), dense_like(k), dense_like(v)

    def setup(ctx, inputs, output):
        (q, k, v, extra), ctx.call, _ = Call.from_op_args(inputs, 4)
        ctx.save_for_backward(q, k, v, *output, *extra)
        ctx.n_settings = _settings_count(inputs)
        # an unused lse must arrive as None, not zeros: its gradient path is dense
        ctx.set_materialize_grads(False)

    def grad(ctx, dout, dlse):
        q, k, v, out, lse, *extra = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, dlse, extra, *ctx.call.op_args())
        return (dq, dk, dv, [None] * len(extra)) + (None,) * ctx.n_settings

    forward_op.register_autograd(grad, setup_context=setup)

    _register(name, forward_impl, backward_impl)
    return forward_op


# ----------------------------------------------------------------------------
# Head-sharding schedules: (out, lse, qh, kh, vh, out_h, lse_h); the backward keeps the last five.
# ----------------------------------------------------------------------------


def _head_sharded_like(t, world_size: int, heads=None):
    heads = t.shape[1] if heads is None else heads
    return t.new_empty(t.shape[0], heads // world_size, t.shape[2] * world_size, *t.shape[3:])


def heads_schedule(name: str, group_names: tuple[str, ...], a2a_index: int, forward: Callable, backward: Callable):
    """Define ``cp::<name>_attention`` (+ ``_backward``) with the group arguments ``group_names``
    (``groups[a2a_index]`` is the all-to-all group) over the schedule's functions

    ``forward(q, k, v, extra, call, enable_gqa) -> (out, lse, qh, kh, vh, out_h, lse_h)`` and
    ``backward(dout, dlse, qh, kh, vh, out_h, lse_h, extra, call, kv_heads) -> (dq, dk, dv)``;
    returns the forward op.
    """
    groups_schema = ", ".join(f"str {g}" for g in group_names)

    def forward_impl(*args):
        (q, k, v, extra), call, enable_gqa = Call.from_op_args(args, 4)
        return _distinct(forward(q, k, v, list(extra), call, enable_gqa), (q, k, v))

    def backward_impl(*args):
        (dout, dlse, qh, kh, vh, out_h, lse_h, extra), call, kv_heads = Call.from_op_args(args, 8)
        res = backward(dout, dlse, qh, kh, vh, out_h, lse_h, list(extra), call, kv_heads)
        return _distinct(res, (dout, dlse, qh, kh, vh, out_h, lse_h))

    forward_op, backward_op = _op_pair(
        name,
        forward_impl,
        groups_schema,
        ", ".join(["Tensor"] * 7),
        backward_impl,
        f"Tensor dout, Tensor? dlse, Tensor qh, Tensor kh, Tensor vh, Tensor out_h, Tensor lse_h, Tensor[] extra, "
        f"{groups_schema}",
        "int kv_heads, ",
    )

    @forward_op.register_fake
    def _(*args):
        (q, k, v, _), call, _ = Call.from_op_args(args, 4)
        kind_entry(call.kind)
        c = world_size_of(call.groups[a2a_index])
        out, lse = result_like(q, v)
        kv_heads = k.shape[1] * replicate_kv_heads(k.shape[1], q.shape[1], c)
        return (
            out,
            lse,
            _head_sharded_like(q, c),
            _head_sharded_like(k, c, kv_heads),
            _head_sharded_like(v, c, kv_heads),
            _head_sharded_like(out, c),
            _head_sharded_like(lse, c),
        )

    @backward_op.register_fake
    def _(*args):
        (dout, _, qh, kh, vh, _, _, _), call, kv_heads = Call.from_op_args(args, 8)
        c = world_size_of(call.groups[a2a_index])
        b, s = dout.shape[0], dout.shape[2]
        return (
            dout.new_empty(b, qh.shape[1] * c, s, qh.shape[-1]),
            dout.new_empty(b, kv_heads, s, kh.shape[-1]),
            dout.new_empty(b, kv_heads, s, vh.shape[-1]),
        )

    def setup(ctx, inputs, output):
        (_, k, _, extra), call, _ = Call.from_op_args(inputs, 4)
        ctx.save_for_backward(*output[2:], *extra)
        ctx.n_extra, ctx.n_settings = len(extra), _settings_count(inputs)
        ctx.a2a_group = call.groups[a2a_index]
        ctx.args = call.op_args(k.shape[1])
        ctx.set_materialize_grads(False)

    def grad(ctx, dout, dlse, *_unused):
        qh, kh, vh, out_h, lse_h, *extra = ctx.saved_tensors
        if dout is None:  # only lse is used: zeros of the sequence-sharded output's shape
            c = world_size_of(ctx.a2a_group)
            dout = out_h.new_zeros(out_h.shape[0], out_h.shape[1] * c, out_h.shape[2] // c, out_h.shape[3])
        dq, dk, dv = backward_op(dout, dlse, qh, kh, vh, out_h, lse_h, extra, *ctx.args)
        return (dq, dk, dv, [None] * ctx.n_extra) + (None,) * ctx.n_settings

    forward_op.register_autograd(grad, setup_context=setup)

    _register(name, forward_impl, backward_impl)
    return forward_op
