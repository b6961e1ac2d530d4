"""``cp::merge_``: one ring step's online-softmax correction, in place, fused on CUDA.

::

    torch.ops.cp.merge_(acc_out, acc_lse, out, lse, row_start=0) -> None

``acc_out [B, H, S, D]`` and ``acc_lse [B, H, S]`` are the fp32 accumulators a
ring schedule keeps. ``out [B, H, S - row_start, D]`` (any float dtype) and
``lse [B, H, S - row_start]`` are one step's partial result for accumulator
rows ``[row_start, S)``; rows before ``row_start`` are not touched. For every
touched row::

    new_lse = logaddexp(acc_lse, lse)
    acc_out = acc_out * exp(acc_lse - new_lse) + out * exp(lse - new_lse)
    acc_lse = new_lse

A row that is -inf on both sides stays out = 0, lse = -inf (never NaN).

On CUDA (with triton installed, fp32 accumulators) one Triton kernel reads
each element once and writes it once, instead of the ~10 full-size temporaries
the eager torch merge allocates. Everywhere else (CPU, fp64 accumulators, no
triton) the op runs ``merge_into_`` from ``merge.py`` (the same arithmetic, in
place), so results agree across devices.

Every ring schedule (SDPA, packed, flex, the hybrids' inner rings) folds each
step after the first into its accumulators with this op and ``row_start=0``.
The step's partial is full-size even where the zigzag step touches only the
second half of the queries (rows it skips are out = 0, lse = -inf): which
section a step computes depends on the rank, read at run time, and a traced
schedule must give the partial one shape on every rank. ``row_start`` serves a
caller that holds a partial for the trailing rows only.

The op has no autograd formula: it is meant for the inside of a schedule
whose differentiable wrapper (e.g. ``cp::ring_attention``) owns the backward.
Under ``torch.compile`` the mutation is functionalised and re-inplaced by
Inductor like any mutating custom op.

Triton is optional: importing ``cp_compile`` never imports it. The kernel
module is imported on the first CUDA call (or by ``merge_triton_`` directly).
Tests run the kernel on CPU tensors through Triton's interpreter by setting
``TRITON_INTERPRET=1`` in a subprocess before anything defines the kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch
from torch import Tensor

from .merge import merge_into_


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is never imported here)."""
    return importlib.util.find_spec("triton") is not None


def check_merge_args(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, row_start: int) -> None:
    if acc_out.dim() != 4 or acc_lse.dim() != 3:
        raise ValueError(
            "merge_: acc_out must be [B, H, S, D] and acc_lse [B, H, S]; "
            f"got {tuple(acc_out.shape)}, {tuple(acc_lse.shape)}"
        )
    b, h, s, d = acc_out.shape
    if tuple(acc_lse.shape) != (b, h, s):
        raise ValueError(f"merge_: acc_lse {tuple(acc_lse.shape)} does not match acc_out {tuple(acc_out.shape)}")
    if not 0 <= row_start <= s:
        raise ValueError(f"merge_: row_start={row_start} outside [0, {s}]")
    rows = s - row_start
    if tuple(out.shape) != (b, h, rows, d) or tuple(lse.shape) != (b, h, rows):
        raise ValueError(
            f"merge_: the partial must cover rows [{row_start}, {s}): expected out {(b, h, rows, d)} and lse "
            f"{(b, h, rows)}, got {tuple(out.shape)} and {tuple(lse.shape)}"
        )
    if acc_out.dtype not in (torch.float32, torch.float64) or acc_lse.dtype != acc_out.dtype:
        raise ValueError(
            f"merge_: accumulators must be fp32 (or fp64) and share a dtype; got {acc_out.dtype}, {acc_lse.dtype}"
        )
    devices = {t.device for t in (acc_out, acc_lse, out, lse)}
    if len(devices) > 1:
        raise ValueError(f"merge_: all four tensors must be on one device; got {sorted(map(str, devices))}")
    if not out.is_floating_point() or not lse.is_floating_point():
        raise ValueError(f"merge_: the partial must be floating point; got {out.dtype}, {lse.dtype}")


def _merge_torch_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, row_start: int) -> None:
    merge_into_(acc_out[:, :, row_start:], acc_lse[:, :, row_start:], out, lse)


@functools.cache
def _kernel():
    # Imported lazily: the interpreter mode (TRITON_INTERPRET) is fixed when the
    # kernel is decorated, and cp_compile must import without triton.
    from . import _merge_kernel

    return _merge_kernel


def merge_triton_(
    acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, row_start: int = 0, block_rows: int = 32
) -> None:
    """Launch the Triton kernel on these tensors (CUDA, or CPU under TRITON_INTERPRET=1)."""
    check_merge_args(acc_out, acc_lse, out, lse, row_start)
    if acc_out.dtype != torch.float32:
        raise ValueError(f"merge_triton_: the kernel takes fp32 accumulators, got {acc_out.dtype}")
    _kernel().launch(acc_out, acc_lse, out, lse, row_start, block_rows)


@torch.library.custom_op("cp::merge_", mutates_args=("acc_out", "acc_lse"))
def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, row_start: int = 0) -> None:
    """Fold a partial (out, lse) for rows [row_start, S) into the accumulators, in place."""
    check_merge_args(acc_out, acc_lse, out, lse, row_start)
    _merge_torch_(acc_out, acc_lse, out, lse, row_start)


@merge_.register_kernel("cuda")
def _(acc_out, acc_lse, out, lse, row_start=0):
    check_merge_args(acc_out, acc_lse, out, lse, row_start)
    if acc_out.dtype == torch.float32 and triton_available():
        _kernel().launch(acc_out, acc_lse, out, lse, row_start, 32)
        return
    if acc_out.dtype == torch.float32:
        _warn_no_triton()
    _merge_torch_(acc_out, acc_lse, out, lse, row_start)


@functools.cache
def _warn_no_triton() -> None:
    # correct either way; said once so that a missing install is not mistaken for the kernel's speed
    warnings.warn(
        "cp::merge_ on CUDA: triton is not installed, so the merge runs as several torch kernels "
        "instead of one Triton kernel (pip install -e '.[triton]')",
        stacklevel=3,
    )


@merge_.register_fake
def _(acc_out, acc_lse, out, lse, row_start=0):
    check_merge_args(acc_out, acc_lse, out, lse, row_start)
    return None
