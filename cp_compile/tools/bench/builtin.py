"""The built-in variants, registered on import in this order (the report order;
the plugins in ``PLUGIN_MODULES`` add theirs after):

``ours eager``             ``cp_compile.ring_attention`` forward + backward on zigzag shards.
``torch ring (alltoall)``  PyTorch's own ring (``_templated_ring_attention`` and its
``torch ring (allgather)`` backward from ``torch.distributed.tensor.experimental``),
                           driven with the same CPU flash kernel as ours
                           (``aten._scaled_dot_product_flash_attention_for_cpu`` and
                           its ``_backward``), on the same zigzag (head-tail) shards,
                           load balancing on for causal, off for non-causal (it
                           refuses otherwise), K/V rotated by all-to-all or by one
                           all-gather (dK/dV always travel by all-to-all).
``single device``          SDPA forward + backward of the full sequence on rank 0
                           (one thread): the reference for correctness and for
                           parallel efficiency.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from .variants import (
    OURS,
    SINGLE,
    TORCH_A2A,
    TORCH_AG,
    Inputs,
    Problem,
    Variant,
    _scale,
    fwd_bwd_step,
    register_variant,
)

# -- single device -------------------------------------------------------------


def _single_setup(p: Problem, x: Inputs):
    return fwd_bwd_step(
        functools.partial(F.scaled_dot_product_attention, is_causal=p.causal), (x.q_full, x.k_full, x.v_full), x.do_full
    )


# -- ours ------------------------------------------------------------------------


def _ours_setup(p: Problem, x: Inputs):
    import cp_compile

    return fwd_bwd_step(functools.partial(cp_compile.ring_attention, is_causal=p.causal), (x.q, x.k, x.v), x.do)


@contextlib.contextmanager
def _stub_our_kernels():
    """Swap the dense attention tiles under every cp op for zero-cost stand-ins."""
    from ...kernels import block

    def fwd(q, k, v, causal, scale):
        lse = torch.zeros(q.shape[:3], dtype=block.acc_dtype(q.dtype), device=q.device)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), lse

    def bwd(dout, q, k, v, out, lse, causal, scale):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    saved = block.tile_fwd, block._tile_bwd
    block.tile_fwd, block._tile_bwd = fwd, bwd
    try:
        yield
    finally:
        block.tile_fwd, block._tile_bwd = saved


def _ours_traced_setup(p: Problem, x: Inputs, stub: bool):
    """The eager schedule called as plain Python, so OpTracer sees each step's ops."""
    from ...comm.groups import group_name_of
    from ...kinds.call import Call
    from ...schedules.ring import ring_backward, ring_forward

    call = Call("sdpa", (group_name_of(None),), p.causal, "zigzag", _scale(p))

    def step():
        with _stub_our_kernels() if stub else contextlib.nullcontext():
            out, lse = ring_forward(x.q, x.k, x.v, [], call, x.world_size, False)
            dq, dk, dv = ring_backward(x.do, x.q, x.k, x.v, out, lse, None, [], call, x.world_size)
        return out, dq, dk, dv

    return step


class _Bytes:
    bytes = 0


@contextlib.contextmanager
def _ours_meter():
    from ...counters import count_traffic

    box = _Bytes()
    with count_traffic() as traffic:
        yield box
    box.bytes = traffic.bytes_sent


# -- PyTorch's ring --------------------------------------------------------------


def _torch_cp():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def _torch_cp_options(load_balance: bool, rotate_method: str):
    """Set torch's global CP options for one call and restore them after."""
    A = _torch_cp()
    saved = A._cp_options.enable_load_balance, A._cp_options.rotate_method
    A._cp_options.enable_load_balance = load_balance
    A.set_rotate_method(rotate_method)
    try:
        yield
    finally:
        A._cp_options.enable_load_balance, A._cp_options.rotate_method = saved


def _stub_flash_fwd(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    lse = torch.zeros(query.shape[:3], dtype=torch.float32, device=query.device)
    return query.new_zeros(*query.shape[:-1], value.shape[-1]), lse


def _stub_flash_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def _torch_ring_setup(p: Problem, x: Inputs, stub: bool = False, *, rotate_method: str):
    """Setup and (with ``stub``) traced setup of torch's ring: the traced run is the same plain call."""
    import torch.distributed as dist

    A = _torch_cp()
    aten = torch.ops.aten
    fwd_op = _stub_flash_fwd if stub else aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = _stub_flash_bwd if stub else aten._scaled_dot_product_flash_attention_for_cpu_backward
    group, scale = dist.group.WORLD, _scale(p)

    def step():
        # load balancing (head-tail = our zigzag) only for causal: torch raises otherwise
        with _torch_cp_options(load_balance=p.causal, rotate_method=rotate_method):
            out, lse = A._templated_ring_attention(
                group, 2, fwd_op, x.q, x.k, x.v, is_causal=p.causal, dropout_p=0.0, scale=scale
            )
            dq, dk, dv = A._templated_ring_attention_backward(
                group,
                2,
                bwd_op,
                x.do,
                "grad_out",
                x.q,
                x.k,
                x.v,
                out,
                lse,
                is_causal=p.causal,
                dropout_p=0.0,
                scale=scale,
            )
        return out, dq, dk, dv

    return step


@contextlib.contextmanager
def _torch_meter():
    """Count the bytes torch's ring hands to its collectives (bytes/rank in the docstring of ``core``)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ft_c

    box = _Bytes()
    others = dist.get_world_size() - 1
    gather = "all_gather_single" if hasattr(ft_c, "all_gather_single") else "all_gather_tensor"  # 2.11: the latter
    saved = {name: getattr(ft_c, name) for name in ("permute_tensor", gather)}

    def permute_tensor(t, *args, **kwargs):
        box.bytes += t.numel() * t.element_size() if others else 0  # C=1: a copy to itself
        return saved["permute_tensor"](t, *args, **kwargs)

    def all_gather(t, *args, **kwargs):
        box.bytes += t.numel() * t.element_size() * others
        return saved[gather](t, *args, **kwargs)

    for name, metered in (("permute_tensor", permute_tensor), (gather, all_gather)):
        setattr(ft_c, name, metered)
    try:
        yield box
    finally:
        for name, original in saved.items():
            setattr(ft_c, name, original)


register_variant(
    Variant(
        OURS,
        _ours_setup,
        "cp_compile.ring_attention, eager, zigzag",
        traced_setup=_ours_traced_setup,
        meter=_ours_meter,
        stub=_stub_our_kernels,
    )
)
for _method, _name in (("alltoall", TORCH_A2A), ("allgather", TORCH_AG)):
    register_variant(
        Variant(
            _name,
            functools.partial(_torch_ring_setup, rotate_method=_method),
            f"torch _templated_ring_attention(+_backward), CPU flash kernel, K/V rotate={_method}",
            traced_setup=functools.partial(_torch_ring_setup, rotate_method=_method),
            meter=_torch_meter,
            devices=("cpu",),
        )
    )
register_variant(
    Variant(SINGLE, _single_setup, "F.scaled_dot_product_attention, full sequence, rank 0", single_rank=True)
)
