"""Benchmark variant "ours packed": the batch packed as documents, ``varlen_attention`` on the ring.

Each batch row is one document of length S, so the per-document zigzag of
the packed layout is exactly the problem's zigzag shard: the variant reuses
the same local tokens, viewed as ``[B * S_local, H, D]`` with
``cu_seqlens = [0, S, 2S, ...]``. Next to "ours eager" it shows what the
per-document tile kernel costs over the dense SDPA ring.
"""

from __future__ import annotations

import torch

from .variants import Inputs, Problem, Variant, fwd_bwd_step, register_variant

OURS_PACKED = "ours packed"


def _packed(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S_local, D] -> [B * S_local, H, D], documents one after another."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def packed_step(attention, x: Inputs):
    """``fwd_bwd_step`` of ``attention(q, k, v)`` on the packed views; results back in [B, H, S_local, D]."""
    b, h, s_local, d = x.q.shape
    step_packed = fwd_bwd_step(attention, [_packed(t) for t in (x.q, x.k, x.v)], _packed(x.do))

    def step():  # as the reference is
        return tuple(t.view(b, s_local, h, -1).transpose(1, 2) for t in step_packed())

    return step


def documents(p: Problem, x: Inputs) -> torch.Tensor:
    """``cu_seqlens`` with each batch row one document of the global length."""
    return torch.arange(x.q.shape[0] + 1, dtype=torch.int32, device=x.q.device) * p.seq_len


def _ours_packed_setup(p: Problem, x: Inputs):
    import cp_compile

    cu = documents(p, x)
    return packed_step(lambda q, k, v: cp_compile.varlen_attention(q, k, v, cu, is_causal=p.causal, schedule="ring"), x)


register_variant(
    Variant(
        name=OURS_PACKED,
        setup=_ours_packed_setup,
        description="cp_compile.varlen_attention on the ring, each batch row one packed document",
        devices=("cpu", "cuda"),
    )
)
