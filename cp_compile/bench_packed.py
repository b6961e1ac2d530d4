"""Benchmark variant "ours packed": the batch packed as documents, ``varlen_attention`` on the ring.

Each batch row is one document of length S, so the per-document zigzag of
the packed layout is exactly the problem's zigzag shard: the variant reuses
the same local tokens, viewed as ``[B * S_local, H, D]`` with
``cu_seqlens = [0, S, 2S, ...]``. Next to "ours eager" it shows what the
per-document tile kernel costs over the dense SDPA ring.
"""

from __future__ import annotations

import torch

from .bench import Inputs, Problem, Variant, _take_grads, register_variant

OURS_PACKED = "ours packed"


def _packed(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S_local, D] -> [B * S_local, H, D], documents one after another."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _ours_packed_setup(p: Problem, x: Inputs):
    import cp_compile

    b, h, s_local, d = x.q.shape
    cu = torch.arange(b + 1, dtype=torch.int32) * p.seq_len
    leaves = [_packed(t).detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
    dout = _packed(x.do)
    unpack = lambda t: t.view(b, s_local, h, -1).transpose(1, 2)  # noqa: E731

    def step():
        out = cp_compile.varlen_attention(*leaves, cu, is_causal=p.causal, schedule="ring")
        out.backward(dout)
        return tuple(unpack(t) for t in (out.detach(), *_take_grads(leaves)))

    return step


register_variant(Variant(
    name=OURS_PACKED,
    setup=_ours_packed_setup,
    description="cp_compile.varlen_attention on the ring, each batch row one packed document",
    devices=("cpu", "cuda"),
))
