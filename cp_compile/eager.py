"""The eager API: one function per kind of attention (and per schedule for dense attention).

Each builds the kind's arguments and calls the chosen schedule's whole op
(``schedules.whole_op``), the same op a compiled graph holds, so eager and
compiled runs share every line of schedule code. ``schedule="auto"`` asks the
cost model (``cost.masked``) for the choice a compiled site would make.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import Tensor

from .comm.agree import refuse_together
from .comm.groups import group_name_of, is_2d_mesh, mesh_groups, resolve_group
from .kinds.base import check_heads_and_lengths
from .kinds.call import Call
from .kinds.flex import FlexSettings, eager_mods
from .kinds.packed import PackedSettings, bhsd, thd, window_of
from .schedules import HEAD_SCHEDULES, check_schedule_name, run_schedule, schedule_groups, softmax_scale

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@contextlib.contextmanager
def _refused_together(q, k, v, group) -> Iterator[None]:
    """Around the checks an eager call makes before its schedule's op: an error there reaches every rank of
    ``group`` (``comm.refuse_together``) instead of leaving the others in the op's first collective."""
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as error:
        if isinstance(group, tuple):
            name = group[0]
        else:
            name = mesh_groups(group)[0] if is_2d_mesh(group) else group_name_of(group)
        refuse_together(error, q, k, v, name)


def _dense(schedule: str, q, k, v, group, is_causal, scale, enable_gqa, layout, dropout_p: float = 0.0) -> Tensor:
    with _refused_together(q, k, v, group):
        if dropout_p:
            raise NotImplementedError(
                f"dropout_p={dropout_p}: attention dropout under context parallelism is not supported; "
                "use dropout_p=0.0"
            )
        call = Call("sdpa", schedule_groups(group, schedule), bool(is_causal), layout, softmax_scale(q, scale))
    return run_schedule(schedule, q, k, v, [], call, enable_gqa)[0]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Union[ProcessGroup, DeviceMesh, str, None] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
    dropout_p: float = 0.0,
) -> Tensor:
    """Ring attention over a sequence sharded across ``group``.

    ``q, k, v`` are this rank's ``[B, H, S_local, D]`` shards, laid out as
    ``layout`` says (``ContextParallel.shard`` produces them). ``is_causal``
    means causal over the whole global sequence. Differentiable. A collective:
    every rank of ``group`` calls it with the same shapes and arguments.

    Args:
        q: this rank's query shard.
        k: this rank's key shard; fewer heads than ``q`` with ``enable_gqa``.
        v: this rank's value shard, as ``k``.
        group: a process group, a 1-D DeviceMesh or its group name; None: the default group.
        is_causal: causal over the global sequence.
        scale: the softmax scale; None: ``1 / sqrt(D)``.
        enable_gqa: grouped-query attention (query heads a multiple of key/value heads).
        layout: the load balance the shards were made with (``"zigzag"`` or ``"contiguous"``).
        dropout_p: must be 0.

    Returns:
        This rank's ``[B, H, S_local, D]`` output, in q's dtype.

    Raises:
        NotImplementedError: ``dropout_p`` is not 0.
        ValueError: shapes, dtypes or arguments that differ between ranks or that CP cannot run
            (raised on every rank, before the first transfer).
    """
    return _dense("ring", q, k, v, group, is_causal, scale, enable_gqa, layout, dropout_p)


def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
) -> Tensor:
    """All-gather CP attention over ``[B, H, S_local, D]`` shards (see ``ring_attention``). Differentiable."""
    return _dense("allgather", q, k, v, group, is_causal, scale, enable_gqa, layout)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
) -> Tensor:
    """All-to-all (Ulysses) attention over a sequence sharded across ``group``.

    Same contract as ``ring_attention``. Query heads must divide by the group size. Differentiable.
    """
    return _dense("ulysses", q, k, v, group, is_causal, scale, enable_gqa, layout)


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
) -> Tensor:
    """Hybrid attention over a 2-D ``(ring, a2a)`` DeviceMesh (or its (flattened, ring, a2a) group names);
    shards as ``ContextParallel(mesh).shard`` makes them.

    Query heads must divide by the all-to-all group size. Differentiable.
    """
    return _dense("hybrid", q, k, v, mesh, is_causal, scale, enable_gqa, layout)


def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod=None,
    block_mask=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    group=None,
    schedule: str = "auto",
    layout: str = "zigzag",
    machine=None,
):
    """FlexAttention over a sequence sharded across ``group``, with torch's signature.

    ``q, k, v`` are this rank's ``[B, H, S_local, D]`` shards; ``block_mask``
    comes from ``ContextParallel.shard(global_block_mask)``; ``score_mod`` reads
    global indices. ``schedule`` is ``"auto"`` (the cost model's choice,
    ``cost.masked.choose_flex``, from the global mask's block counts recorded
    by the shard and ``machine``, a ``cp_compile.Machine``, default: the device
    type's profile; the same choice a compiled site makes), ``"ring"``,
    ``"allgather"``, ``"ulysses"`` (query heads must divide by C) or ``"hybrid"``
    (``group`` a 2-D (ring, a2a) DeviceMesh, query heads divide by its a2a
    size); ``layout`` matters only without a block_mask.
    Differentiable (mask and score mods; tensors the mods capture get no gradient). Called inside
    ``torch.compile``: a call with a block_mask from ``plan.shard`` (or none) traces whole, one with a
    score_mod breaks the graph where it makes its mods (an opaque object, which Dynamo cannot create); a
    compiled model may call torch's ``flex_attention`` instead, which the CP backend rewrites.
    """
    with _refused_together(q, k, v, group):
        check_heads_and_lengths(q, k, enable_gqa)
        mods, buffers, mask_b, mask_h = eager_mods(block_mask, score_mod)
        if schedule == "auto":
            from .cost.masked import choose_flex

            schedule = (
                "hybrid"
                if is_2d_mesh(group)
                else choose_flex(q, k, v, block_mask, resolve_group(group_name_of(group)).size(), machine)[0]
            )
        check_schedule_name(schedule)
        groups = schedule_groups(group, schedule)
    call = Call("flex", groups, False, layout, softmax_scale(q, scale), FlexSettings(mask_b, mask_h), mods)
    out, lse = run_schedule(schedule, q, k, v, buffers, call, q.shape[1] != k.shape[1])
    return (out, lse) if return_lse else out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    group=None,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    schedule: str = "auto",
    machine=None,
    chunk: int = 0,
    softcap: float = 0.0,
    return_lse: bool = False,
    across_documents: bool = False,
):
    """CP attention over packed documents. Differentiable.

    ``q, k, v`` are this rank's ``[T_local, H, D]`` slots (``ContextParallel.shard(x, 0,
    cu_seqlens=cu)``); ``cu_seqlens`` is the global int32 tensor of document
    boundaries, as on one device. ``window_size=(left, right)`` as in torch's
    ``varlen_attn`` (-1 unbounded; ``(-1, 0)`` or ``is_causal=True``: causal).
    ``chunk > 0`` limits each query to keys in its own chunk of ``chunk``
    positions of its document (chunked attention); ``softcap > 0`` caps every
    score at ``softcap * tanh(score / softcap)``; ``return_lse`` also returns
    the log-sum-exp ``[T_local, H]`` (fp32; fp64 for fp64 input), differentiable;
    ``across_documents`` lets the documents see each other as one sequence (the
    window over positions in the packed row, the tokens still sharded as
    documents): what a model whose mask ignores the documents computes.
    ``schedule`` is ``"allgather"``, ``"ring"``, ``"ulysses"`` (query heads
    must divide by C), ``"hybrid"`` (``group`` a 2-D (ring, a2a) DeviceMesh;
    query heads must divide by its a2a size) or ``"auto"``: the cost model's
    choice (``cost.masked.choose_packed``) from the documents, the window and
    ``machine`` (a ``cp_compile.Machine``; default: the device type's profile),
    the same choice a compiled ``varlen_attn`` site makes. Inside a compiled
    region the documents are not known while tracing, and ``"auto"`` means
    ``"allgather"``.
    """
    with _refused_together(q, k, v, group):
        left, right = window_of(window_size, is_causal)
        if schedule == "auto" and (is_2d_mesh(group) or isinstance(group, tuple)):
            schedule = "hybrid"
        elif schedule == "auto" and torch.compiler.is_compiling():
            schedule = "allgather"
        elif schedule == "auto":
            from .cost.masked import choose_packed

            schedule = choose_packed(
                q, k, v, cu_seqlens, resolve_group(group_name_of(group)).size(), (left, right), machine
            )[0]
        check_schedule_name(schedule)
        if across_documents and chunk:
            raise ValueError("across_documents with chunk: chunks are counted within documents")
        settings = PackedSettings(left, right, chunk, softcap, int(across_documents))
        call = Call("packed", schedule_groups(group, schedule), False, "packed", softmax_scale(q, scale), settings)
    heads = schedule in HEAD_SCHEDULES  # they exchange [B, H, S, D]: packed tensors travel as [1, H, T, D]
    qkv = (bhsd(q), bhsd(k), bhsd(v)) if heads else (q, k, v)
    out, lse = run_schedule(schedule, *qkv, [cu_seqlens], call, enable_gqa)
    if heads:
        out, lse = thd(out), thd(lse)
    return (out, lse) if return_lse else out


def cached_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    q_positions: Tensor,
    k_positions: Tensor,
    group=None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    chunk: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Attention of queries every rank holds to a KV cache sharded over ``group`` (inference).

    ``q [B, Hq, Lq, D]`` is the same on every rank, at global positions ``q_positions [Lq]``;
    ``k_cache, v_cache [B, Hkv, L, D]`` are this rank's cache slots, ``k_positions [L]`` the global
    position of each slot's token (``cp_compile.kernels.block.EMPTY_POSITION`` for an empty slot).
    A key is visible when it is not after the query and, with ``window``, fewer than ``window``
    positions before it (transformers' ``sliding_window``) and, with ``chunk``, in the query's chunk
    of ``chunk`` positions; ``softcap > 0`` caps the scores. Every rank gets the same result: each
    attends to its own slots, then the partial results merge exactly across ranks. GQA when
    ``Hq`` is a multiple of ``Hkv``. Not differentiable.
    """
    from .inference.cached import CachedSettings, check_cached_args

    group_name = group_name_of(group)
    with _refused_together(q, k_cache, v_cache, group_name):
        check_cached_args(q, k_cache, v_cache, q_positions, k_positions)
        left = -1 if window is None else int(window) - 1
        scale = softmax_scale(q, scale)
    # the ranks' caches may hold different numbers of slots: compare everything else
    torch.ops.cp.agree(
        q,
        k_cache.narrow(2, 0, 0),
        v_cache.narrow(2, 0, 0),
        group_name,
        f"cached_attention left={left} scale={scale} {CachedSettings(chunk, softcap).encode()}",
    )
    return torch.ops.cp.cached_attention(
        q, k_cache, v_cache, q_positions, k_positions, group_name, left, scale, CachedSettings(chunk, softcap).encode()
    )[0]
