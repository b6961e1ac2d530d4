"""The Triton kernel behind ``cp::merge_`` (see ``triton_merge.py``). Imports triton.

One program handles ``BLOCK_M`` rows of one (batch, head) pair and the whole
head dimension (padded to a power of two). Per row it computes the two merge
weights once, in fp32, against a finite pivot (the larger lse, or 0 when both
are -inf), so ``exp`` never sees ``-inf - (-inf)``::

    m       = max(acc_lse, lse)          (0 if both are -inf)
    w_acc   = exp(acc_lse - m),  w_new = exp(lse - m)
    new_lse = m + log(w_acc + w_new)     (-inf when both weights are 0)
    acc_out = (acc_out * w_acc + out * w_new) / (w_acc + w_new)   (0 when both are 0)

which equals ``acc_out * exp(acc_lse - new_lse) + out * exp(lse - new_lse)``
with two exps per row instead of two exps and a logaddexp. Offsets are int64, so tensors with more
than 2**31 elements are fine.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_rows_kernel(
    acc_out_ptr,
    acc_lse_ptr,
    out_ptr,
    lse_ptr,
    rows,
    row_start,
    heads,
    head_dim,
    sa_b,
    sa_h,
    sa_s,
    sa_d,
    sl_b,
    sl_h,
    sl_s,
    so_b,
    so_h,
    so_s,
    so_d,
    sp_b,
    sp_h,
    sp_s,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # row blocks on axis 0 (up to 2**31 - 1 programs), (batch, head) on axis 1 (up to 65535)
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // heads
    h = pid_bh % heads

    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # row of the partial
    row_ok = r < rows
    acc_r = r + row_start  # row of the accumulator
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    col_ok = d < head_dim

    acc_lse_ptrs = acc_lse_ptr + b * sl_b + h * sl_h + acc_r * sl_s
    a_lse = tl.load(acc_lse_ptrs, mask=row_ok, other=float("-inf"))
    p_lse = tl.load(lse_ptr + b * sp_b + h * sp_h + r * sp_s, mask=row_ok, other=float("-inf")).to(tl.float32)

    m = tl.maximum(a_lse, p_lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_acc = tl.exp(a_lse - m)
    w_new = tl.exp(p_lse - m)
    total = w_acc + w_new
    seen = total > 0.0  # False only for rows that are -inf on both sides
    safe = tl.where(seen, total, 1.0)
    new_lse = tl.where(seen, m + tl.log(safe), float("-inf"))
    c_acc = w_acc / safe  # both weights are 0 on unseen rows: out stays 0
    c_new = w_new / safe

    mask = row_ok[:, None] & col_ok[None, :]
    acc_ptrs = acc_out_ptr + b * sa_b + h * sa_h + acc_r[:, None] * sa_s + d[None, :] * sa_d
    out_ptrs = out_ptr + b * so_b + h * so_h + r[:, None] * so_s + d[None, :] * so_d
    acc = tl.load(acc_ptrs, mask=mask, other=0.0)
    part = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(acc_ptrs, acc * c_acc[:, None] + part * c_new[:, None], mask=mask)
    tl.store(acc_lse_ptrs, new_lse, mask=row_ok)


def launch(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, row_start: int, block_rows: int) -> None:
    """Arguments already checked by the caller (``check_merge_args``)."""
    b, h, s, d = acc_out.shape
    rows = s - row_start
    if rows == 0 or b * h == 0 or d == 0:
        return
    block_d = triton.next_power_of_2(d)
    # keep a program's tile around 4K elements for large head dims
    block_m = max(1, min(block_rows, 4096 // block_d))
    block_m = triton.next_power_of_2(block_m)
    if b * h > 65535:
        raise ValueError(f"merge_ kernel: batch x heads = {b * h} exceeds the CUDA grid limit 65535")
    grid = (triton.cdiv(rows, block_m), b * h)
    device = torch.cuda.device(acc_out.device) if acc_out.is_cuda else contextlib.nullcontext()
    with device:  # launch on the tensors' GPU, not the current one
        _merge_rows_kernel[grid](
            acc_out,
            acc_lse,
            out,
            lse,
            rows,
            row_start,
            h,
            d,
            *acc_out.stride(),
            *acc_lse.stride(),
            *out.stride(),
            *lse.stride(),
            BLOCK_M=block_m,
            BLOCK_D=block_d,
        )
