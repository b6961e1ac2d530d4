"""Linear recurrences over a shard: all-to-all to head groups, the unmodified scan over the whole sequence,
all-to-all back.

The per-token inputs of one head group travel together: a gated-delta-rule group is one key head with
the value heads it serves (grouped value attention), a Mamba2 group one B/C group with its heads (or,
when C does not divide the groups, one head with its own copy of B and C). Tensors of one dtype share
one all-to-all. Groups are padded with zeros up to a multiple of C: a zero head reads nothing and writes
nothing, and its output is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import Sharding, SideBySide
from .gathered import _real
from .heads import from_head_groups, gather_groups, rank_slice, to_head_groups
from .state import gated_delta_rule_states, mamba2_scan_states


def _pad_groups(x: Tensor, groups: int, dim: int) -> Tensor:
    missing = groups - x.shape[dim]
    if not missing:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return F.pad(x, pad)


def _exchange(tensors: Sequence[Tensor], padded: int, sharding: Sharding, to_groups: bool) -> list[Tensor]:
    """``[B, L, G, w_i]`` tensors (``G`` padded to ``padded``) through one exchange per dtype."""
    op = to_head_groups if to_groups else from_head_groups
    out: list[Optional[Tensor]] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        widths = [tensors[i].shape[-1] for i in members]
        packed = torch.cat([_pad_groups(tensors[i], padded, 2) if to_groups else tensors[i] for i in members], -1)
        moved = op(packed, *sharding.op_args)
        for i, part in zip(members, moved.split(widths, -1)):
            out[i] = part
    return out  # type: ignore[return-value]


def _padded(groups: int, sharding: Sharding) -> int:
    return -(-groups // sharding.world_size) * sharding.world_size


def _mine(x: Tensor, padded: int, sharding: Sharding) -> Tensor:
    """This rank's groups of a tensor every rank holds (groups along dim 0)."""
    return rank_slice(_pad_groups(x, padded, 0), sharding.group_name)


def _sequence_cu(cu_seqlens: Optional[Tensor], total: int) -> Optional[Tensor]:
    """Document offsets over the exchanged stream: the padding slots after the last document as one more. One
    document is no document: the scan runs through it as it does given none (a sharded prefill's prompt)."""
    if cu_seqlens is None or cu_seqlens.shape[0] <= 2:
        return None
    cu = cu_seqlens.to(torch.int32 if cu_seqlens.dtype == torch.int32 else torch.int64)
    return torch.cat([cu, cu.new_tensor([total])]) if int(cu[-1]) < total else cu


def _side_by_side(cu: Tensor, total: int) -> SideBySide:
    """Documents ``cu`` covering a stream of ``total`` rows, side by side in the batch, each padded at its end."""
    starts, lengths = cu[:-1].long(), cu.diff().long()
    longest = int(lengths.max())
    offsets = torch.arange(longest, device=cu.device)
    rows = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, total)
    document = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    back = document * longest + torch.arange(total, device=cu.device) - starts[document]
    return SideBySide(rows, back)


def _run_per_document(scan: Callable, cu: Optional[Tensor], tokens: Sequence[Tensor], call: Callable):
    """``call(scan, *tokens)`` (``tokens``: ``[1, S, ...]`` tensors of the whole stream) as a kernel restarting at
    the documents ``cu`` computes it: each document a row of the batch from a zero state, its end padded with
    zeros (a causal scan's outputs never read what comes after them), the padding's outputs dropped. Returns
    ``(out [1, S, ...], per-document final states or None)``. ``cu`` None: one call over the stream."""
    if cu is None:
        return call(scan, *tokens)
    total = tokens[0].shape[1]
    if tokens[0].shape[0] != 1:
        raise ValueError("documents restarting a scan are packed in one row (batch size 1)")
    documents = _side_by_side(cu, total)
    out, final = call(scan, *(documents.split(t) for t in tokens))
    return documents.join(out), final


def gated_delta_rule_heads(
    scan: Callable,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    sharding: Sharding,
    *,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """``scan(query, key, value, g, beta, ...)`` (transformers' ``torch_chunk_gated_delta_rule`` or fla's
    ``chunk_gated_delta_rule``: q, k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]``, g, beta ``[B, L, Hv]``; KDA's
    ``chunk_kimi_delta_attention`` with g ``[B, L, Hv, dk]``) of this
    rank's shard, as one process computes it. ``initial_state`` is every rank's whole ``[B, Hv, dk, dv]``; the
    final state comes back whole on every rank. ``cu_seqlens``: global document offsets the scan restarts at
    (as fla's kernel given them does: the documents run side by side in the batch, so that any ``scan`` restarts
    there; the final states are then one per document)."""
    b, local_len, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    r = hv // hk
    padded = _padded(hk, sharding)
    gate = g.shape[3:]  # () for a gate per head, (dk,) for KDA's gate per key channel
    per_group = [
        query,
        key,
        value.reshape(b, local_len, hk, r * dv),
        g.reshape(b, local_len, hk, -1),
        beta.reshape(b, local_len, hk, r),
    ]
    q, k, v, gg, bb = _exchange(per_group, padded, sharding, to_groups=True)
    total, mine = q.shape[1], q.shape[2]
    init = None
    if initial_state is not None:
        init = _mine(initial_state.reshape(b, hk, r, dk, dv).movedim(1, 0), padded, sharding)
        init = init.movedim(0, 1).reshape(b, mine * r, dk, dv)
    documents = _sequence_cu(cu_seqlens, total)
    if documents is not None and init is not None:
        raise ValueError("gated_delta_rule under CP: an initial state with documents restarting the scan")

    def call(scan, q, k, v, g, beta):
        return scan(q, k, v, g=g, beta=beta, initial_state=init, output_final_state=output_final_state, **kwargs)

    per_token = (q, k, v.reshape(b, total, mine * r, dv), gg.reshape(b, total, mine * r, *gate))
    out, final = _run_per_document(scan, documents, (*per_token, bb.reshape(b, total, mine * r)), call)
    (out,) = _exchange([out.reshape(b, total, mine, r * dv)], padded, sharding, to_groups=False)
    out = out[:, :, :hk].reshape(b, local_len, hv, dv)
    if final is not None:
        states = final.shape[0]  # b, or one per document
        final = gather_groups(final.reshape(states, mine, r, dk, dv), sharding.group_name)[:, :hk]
        final = final.reshape(states, hv, dk, dv)
    return out, final


def mamba2_scan_heads(
    scan: Callable,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    sharding: Sharding,
    *,
    D: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    initial_states: Optional[Tensor] = None,
    return_final_states: bool = False,
    seq_idx: Optional[Tensor] = None,
    **kwargs,
):
    """``scan(hidden_states, dt, A, B, C, chunk_size, D=..., dt_bias=..., ...)`` (transformers'
    ``mamba2_chunk_scan`` or mamba_ssm's ``mamba_chunk_scan_combined``: x ``[B, L, H, P]``, dt ``[B, L, H]``,
    B, C ``[B, L, G, N]``, A, dt_bias ``[H]``, D ``[H]`` or ``[H, P]``) of this rank's shard, as one process
    computes it. ``initial_states`` ``[B, H, P, N]`` is every rank's whole; so is the final state. ``seq_idx``
    given (a kernel restarting at documents, as mamba_ssm's does), the scan restarts at the documents of
    ``sharding.cu_seqlens`` (side by side in the batch; the final states are then one per document)."""
    b, local_len, heads, p = hidden_states.shape
    groups, n = B.shape[2], B.shape[3]
    if groups % sharding.world_size:  # each head with its own copy of its group's B and C: heads split unevenly
        B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
        groups = heads
    per = heads // groups
    padded = _padded(groups, sharding)
    per_group = [hidden_states.reshape(b, local_len, groups, per * p), dt.reshape(b, local_len, groups, per), B, C]
    x, dtm, bm, cm = _exchange(per_group, padded, sharding, to_groups=True)
    total, mine = x.shape[1], x.shape[2]
    real = _real(local_len, sharding)
    if return_final_states and real < total:  # the padding slots after the last token would decay the state
        x, dtm, bm, cm = (t[:, :real] for t in (x, dtm, bm, cm))

    def params(t: Optional[Tensor]) -> Optional[Tensor]:
        if t is None:
            return None
        return _mine(t.reshape(groups, -1), padded, sharding).reshape(mine * per, *t.shape[1:])

    init = None
    if initial_states is not None:
        init = _mine(initial_states.reshape(b, groups, per, p, n).movedim(1, 0), padded, sharding)
        init = init.movedim(0, 1).reshape(b, mine * per, p, n)
    documents = None
    if seq_idx is not None:
        if sharding.cu_seqlens is None:
            raise ValueError("mamba2_scan under CP: seq_idx without the documents' cu_seqlens")
        if init is not None:
            raise ValueError("mamba2_scan under CP: an initial state with documents restarting the scan")
        documents = _sequence_cu(sharding.cu_seqlens, x.shape[1])

    def call(scan, x, dt, B, C):
        result = scan(
            x,
            dt,
            params(A),
            B,
            C,
            chunk_size,
            D=params(D),
            dt_bias=params(dt_bias),
            initial_states=init,
            return_final_states=return_final_states,
            **kwargs,
        )
        return result if return_final_states else (result, None)

    per_token = (x.reshape(b, x.shape[1], mine * per, p), dtm.reshape(b, x.shape[1], mine * per), bm, cm)
    out, final = _run_per_document(scan, documents, per_token, call)
    out = F.pad(out.reshape(b, x.shape[1], mine, per * p), (0, 0, 0, 0, 0, total - x.shape[1]))
    (out,) = _exchange([out], padded, sharding, to_groups=False)
    out = out[:, :, :groups].reshape(b, local_len, heads, p)
    if not return_final_states:
        return out
    states = final.shape[0]  # b, or one per document
    final = gather_groups(final.reshape(states, mine, per, p, n), sharding.group_name)[:, :groups]
    return out, final.reshape(states, heads, p, n)


def selective_scan(
    scan: Callable,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    sharding: Sharding,
    *,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    delta_bias: Optional[Tensor] = None,
    return_last_state: bool = False,
    **kwargs,
):
    """``scan(hidden_states, dt, A, B, C, D=..., z=..., delta_bias=..., ...)`` (Mamba1's selective scan:
    transformers' ``mamba_selective_scan`` or mamba_ssm's ``selective_scan_fn``; x, dt, z ``[B, D, L]``, A
    ``[D, N]``, B, C ``[B, N, L]``, D and delta_bias ``[D]``) of this rank's shard, as one process computes it:
    an all-to-all to channel groups (every channel is its own recurrence), B and C to every rank whole (one copy
    a rank: they are shared by all channels), the scan over the whole sequence for 1/C of the channels. The last
    state ``[B, D, N]`` comes back whole on every rank."""
    sharding.agree("selective_scan", (hidden_states, dt, B))
    b, channels, local_len = hidden_states.shape
    c = sharding.world_size
    padded = _padded(channels, sharding)
    per_channel = [t.transpose(1, 2)[..., None] for t in (hidden_states, dt) + ((z,) if z is not None else ())]
    shared = torch.cat([B, C], 1).transpose(1, 2)[:, :, None].expand(b, local_len, c, 2 * B.shape[1])
    moved = _exchange(per_channel, padded, sharding, to_groups=True)
    (both,) = _exchange([shared], c, sharding, to_groups=True)  # a copy for every rank: an all-gather
    x, dtm, *zm = (t[..., 0].transpose(1, 2) for t in moved)  # [B, D / C, S]
    bm, cm = both[:, :, 0].transpose(1, 2).split(B.shape[1], 1)  # [B, N, S]
    total = x.shape[-1]
    real = _real(local_len, sharding)
    if return_last_state and real < total:  # the padding slots after the last token would decay the state
        x, dtm, bm, cm, *zm = (t[..., :real] for t in (x, dtm, bm, cm, *zm))

    def params(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else _mine(t, padded, sharding)

    result = scan(
        x,
        dtm,
        params(A),
        bm,
        cm,
        D=params(D),
        z=zm[0] if zm else None,
        delta_bias=params(delta_bias),
        return_last_state=return_last_state,
        **kwargs,
    )
    out, last = result if return_last_state else (result, None)
    out = F.pad(out, (0, total - out.shape[-1]))
    (out,) = _exchange([out.transpose(1, 2)[..., None]], padded, sharding, to_groups=False)
    out = out[:, :, :channels, 0].transpose(1, 2)
    if not return_last_state:
        return out
    return out, gather_groups(last, sharding.group_name)[:, :channels]


def gated_delta_rule(
    scan: Callable, query, key, value, g, beta, sharding: Sharding, *, route: str = "heads", **kwargs
) -> tuple[Tensor, Optional[Tensor]]:
    """``gated_delta_rule_heads``'s call by ``route``: ``"heads"`` (the all-to-all) or ``"states"`` (state
    passing, ``state.gated_delta_rule_states``)."""
    sharding.agree("gated_delta_rule", (query, value, g), f"route={route}")
    run = gated_delta_rule_states if route == "states" else gated_delta_rule_heads
    return run(scan, query, key, value, g, beta, sharding, **kwargs)


def mamba2_scan(
    scan: Callable, hidden_states, dt, A, B, C, chunk_size: int, sharding: Sharding, *, route: str = "heads", **kwargs
):
    """``mamba2_scan_heads``'s call by ``route``: ``"heads"`` (the all-to-all) or ``"states"`` (state passing,
    ``state.mamba2_scan_states``)."""
    sharding.agree("mamba2_scan", (hidden_states, dt, B), f"route={route} chunk_size={chunk_size}")
    run = mamba2_scan_states if route == "states" else mamba2_scan_heads
    return run(scan, hidden_states, dt, A, B, C, chunk_size, sharding, **kwargs)


__all__ = ["gated_delta_rule", "gated_delta_rule_heads", "mamba2_scan", "mamba2_scan_heads", "selective_scan"]
