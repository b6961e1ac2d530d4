"""Run the cp::merge_ Triton kernel on CPU tensors under Triton's interpreter.

Started by test_triton_merge.py in a subprocess with TRITON_INTERPRET=1, so the
interpreter mode never leaks into the test process. Prints one JSON object:
case name -> error measures against ``merge_partial`` (the eager torch merge).
"""

from __future__ import annotations

import json
import os
import sys

import torch

NEG_INF = float("-inf")


def make_case(b, h, s, d, dtype, row_start, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    rows = s - row_start
    acc_out = torch.randn(b, h, s, d, generator=g)
    acc_lse = torch.randn(b, h, s, generator=g) * 3
    if strided:  # the partial as a view of a [B, S, H, D] tensor, lse as a slice
        out = torch.randn(b, rows, h, d, generator=g).to(dtype).transpose(1, 2)
        lse = (torch.randn(b, h, 2 * rows, generator=g) * 3)[:, :, ::2]
    else:
        out = torch.randn(b, h, rows, d, generator=g).to(dtype)
        lse = torch.randn(b, h, rows, generator=g) * 3
    if rows >= 4:
        # row 0 of the partial: -inf on both sides; row 1: only the accumulator
        # is -inf; row 2: only the partial is -inf.
        acc_lse[:, :, row_start], acc_out[:, :, row_start] = NEG_INF, 0.0
        out[:, :, 0], lse[:, :, 0] = 0.0, NEG_INF
        acc_lse[:, :, row_start + 1], acc_out[:, :, row_start + 1] = NEG_INF, 0.0
        out[:, :, 2], lse[:, :, 2] = 0.0, NEG_INF
    if row_start:
        acc_lse[:, :, 0] = NEG_INF  # untouched rows stay exactly as they were
    return acc_out, acc_lse, out, lse


CASES = {
    "fp32": dict(b=2, h=3, s=40, d=64, dtype=torch.float32, row_start=0),
    "bf16": dict(b=2, h=3, s=40, d=64, dtype=torch.bfloat16, row_start=0),
    "fp16": dict(b=1, h=2, s=33, d=32, dtype=torch.float16, row_start=0),
    "row_offset_half": dict(b=2, h=2, s=48, d=64, dtype=torch.float32, row_start=24),
    "row_offset_odd_bf16": dict(b=1, h=3, s=37, d=24, dtype=torch.bfloat16, row_start=11),
    "row_offset_all": dict(b=1, h=2, s=16, d=8, dtype=torch.float32, row_start=16),
    "head_dim_not_pow2": dict(b=1, h=2, s=70, d=40, dtype=torch.float32, row_start=3),
    "head_dim_256": dict(b=1, h=1, s=45, d=256, dtype=torch.float32, row_start=0),
    "strided_partial": dict(b=2, h=3, s=30, d=16, dtype=torch.bfloat16, row_start=6, strided=True),
}


def run_case(spec, seed):
    from cp_compile.kernels.merge import merge_partial
    from cp_compile.kernels.triton_merge import merge_triton_

    acc_out, acc_lse, out, lse = make_case(seed=seed, **spec)
    rs = spec["row_start"]
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    if rs < acc_out.shape[2]:
        new_out, new_lse = merge_partial(want_out[:, :, rs:], want_lse[:, :, rs:], out, lse)
        want_out[:, :, rs:], want_lse[:, :, rs:] = new_out, new_lse
    got_out, got_lse = acc_out.clone(), acc_lse.clone()
    merge_triton_(got_out, got_lse, out, lse, rs)
    finite = torch.isfinite(want_lse)
    return {
        "out_err": (got_out - want_out).abs().max().item(),
        "lse_err": (got_lse[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0,
        "same_neginf": torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)),
        "nan": bool(got_out.isnan().any() or got_lse.isnan().any()),
        "head_untouched": torch.equal(got_out[:, :, :rs], acc_out[:, :, :rs])
        and torch.equal(got_lse[:, :, :rs], acc_lse[:, :, :rs]),
        "unseen_rows_zero": bool((got_out[:, :, rs:][torch.isneginf(got_lse[:, :, rs:])] == 0).all()),
        "dtypes": [str(got_out.dtype), str(got_lse.dtype)],
    }


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("TRITON_INTERPRET=1 must be set before triton is imported", file=sys.stderr)
        return 2
    results = {name: run_case(spec, seed) for seed, (name, spec) in enumerate(CASES.items())}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
