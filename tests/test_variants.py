"""Attention variants of the model families users bring, on real gloo ranks against one device.

- chunked attention (Llama 4) and logit soft-capping (Gemma 2): the packed kind's ``chunk`` and
  ``softcap`` options, every schedule, packed documents and rows alike;
- query/key wider than value (multi-head latent attention): the dense schedules and the packed kind;
- the kernels' pieces (the capped math path and its backward, padded fused kernels) in one process.
"""

import pytest
import torch
from helpers import make_qkv, max_err, sdpa_with_grads

from cp_compile.layout import packed

LENGTHS = [13, 1, 0, 3, 22, 5]  # lengths that do not divide by 2C, a zero-length and a one-token document
# (window, chunk, softcap): what each family's layers ask for
VARIANTS = {
    "chunk": ((-1, 0), 4, 0.0),  # Llama 4's chunked layers
    "chunk-window": ((5, 0), 4, 0.0),
    "softcap": ((-1, 0), 0, 1.5),  # Gemma 2's global layers (a small cap: most scores are capped)
    "softcap-window": ((3, 0), 0, 1.5),  # Gemma 2's sliding layers
    "softcap-bidirectional": ((-1, -1), 0, 1.5),
}


def reference(q, k, v, do, cu, window, chunk, softcap):
    """fp64 attention of packed [T, H, D] tensors on one device, mask and cap written out, with gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    bounds = cu.tolist()
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))
    pos = torch.arange(bounds[-1]) - torch.tensor(bounds)[doc]
    behind = pos[:, None] - pos[None, :]
    visible = doc[:, None] == doc[None, :]
    left, right = window
    if left >= 0:
        visible &= behind <= left
    if right >= 0:
        visible &= -behind <= right
    if chunk:
        visible &= (pos[:, None] // chunk) == (pos[None, :] // chunk)
    groups = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, kr) / q.shape[-1] ** 0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", p, vr)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def packed_inputs(lengths, hq, hkv, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (
        torch.randn(total, hq, d, generator=g, dtype=torch.float64),
        torch.randn(total, hkv, d, generator=g, dtype=torch.float64),
    )
    v, do = (
        torch.randn(total, hkv, dv, generator=g, dtype=torch.float64),
        torch.randn(total, hq, dv, generator=g, dtype=torch.float64),
    )
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, do, cu


def run_packed_variants(lengths, hq, hkv, d, dv, schedules):
    """fp64 error of every variant and schedule on this rank, against ``reference``."""
    import cp_compile

    plan = cp_compile.ContextParallel()
    q, k, v, do, cu = packed_inputs(lengths, hq, hkv, d, dv)
    errors = {}
    for name, (window, chunk, softcap) in VARIANTS.items():
        want = reference(q, k, v, do, cu, window, chunk, softcap)
        for schedule in schedules:
            if schedule == "ulysses" and hq % plan.world_size:
                continue
            leaves = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
            out = cp_compile.varlen_attention(
                *leaves, cu, window_size=window, enable_gqa=hq != hkv, schedule=schedule, chunk=chunk, softcap=softcap
            )
            out.backward(plan.shard(do, 0, cu_seqlens=cu))
            got = [out.detach()] + [t.grad for t in leaves]
            real = packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
            errors[name, schedule] = max(
                max_err(g[real], plan.shard(w, 0, cu_seqlens=cu)[real]) for g, w in zip(got, want)
            )
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chunk_and_softcap_fp64_equal_one_device(ranks, world_size):
    for errors in ranks(world_size, run_packed_variants, LENGTHS, 4, 2, 8, 8, ("allgather", "ring", "ulysses")):
        assert errors and max(errors.values()) < 1e-10, errors


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_packed_value_narrower_than_query_fp64(ranks, world_size):
    """Multi-head latent attention's head dims (query/key 12, value 8) through the packed kind."""
    for errors in ranks(world_size, run_packed_variants, [9, 16], 4, 4, 12, 8, ("allgather", "ring")):
        assert max(errors.values()) < 1e-10, errors


def run_dense_mla(d, dv, causal, schedule):
    """A dense schedule with value heads narrower (or wider) than query/key heads, against SDPA."""
    import cp_compile

    plan = cp_compile.ContextParallel()
    q, k, v, do = make_qkv(2, 4, 2, 8 * plan.world_size, d, dv=dv)
    want = sdpa_with_grads(q, k, v, do, is_causal=causal)
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    attention = {
        "ring": cp_compile.ring_attention,
        "allgather": cp_compile.allgather_attention,
        "ulysses": cp_compile.ulysses_attention,
    }[schedule]
    out = attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(plan.shard(do, 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return max(max_err(g, plan.shard(w, 2)) for g, w in zip(got, want))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
def test_dense_schedules_with_unequal_head_dims(ranks, world_size, schedule):
    if schedule == "ulysses" and world_size == 3:
        pytest.skip("Ulysses needs the 4 query heads to divide by C")
    for d, dv, causal in [(24, 16, True), (8, 12, False)]:
        for err in ranks(world_size, run_dense_mla, d, dv, causal, schedule):
            assert err < 1e-10, (d, dv, causal, err)


def accuracy_args(variant: str):
    """The accuracy command's settings at test size: windows and chunks shorter than the sequence."""
    import argparse

    return argparse.Namespace(
        seq=192,
        heads=12,
        kv_heads=4,
        head_dim=32,
        dtype="bf16",
        causal=True,
        variant=variant,
        window=40,
        chunk=48,
        softcap=5.0,
        schedules=["ring", "allgather", "ulysses"],
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bf16_within_twice_one_device_error(ranks, world_size):
    """Every variant and schedule in bf16 against fp64, as ``python -m cp_compile accuracy --variant`` measures
    it: at most 2x the error of one device in bf16 (SDPA with the variant's mask, or transformers' eager
    attention for caps and sinks), and exact in fp64."""
    from cp_compile.tools.bench.accuracy import VARIANTS, errors_rank

    for variant in VARIANTS:
        for row in ranks(world_size, errors_rank, accuracy_args(variant)):
            for schedule in ("ring", "allgather", "ulysses"):
                assert row[schedule]["ratio"] <= 2.0, (variant, schedule, row)
                assert row[schedule]["fp64"] < 1e-10, (variant, schedule, row)


# ----------------------------------------------------------------------------
# Kernels, one process.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "causal", "band"])
def test_capped_math_tile_matches_autograd(mask):
    from cp_compile.kernels.block import math_attn_backward_impl, math_attn_impl, tile_visible

    q, k, v, do = make_qkv(1, 4, 2, 7, 8)
    visible = tile_visible(mask, 7, 7, 0, (2, 0), None)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", ref_q, ref_k.repeat_interleave(2, 1)) * 0.4
    s = torch.tanh(s / 1.5) * 1.5
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    want = torch.softmax(s, -1) @ ref_v.repeat_interleave(2, 1)
    want.backward(do)
    out, lse = math_attn_impl(q, k, v, visible, 0.4, softcap=1.5)
    grads = math_attn_backward_impl(do, q, k, v, out, lse, visible, 0.4, None, softcap=1.5)
    assert max_err(out, want) < 1e-12
    for g, w in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad)):
        assert max_err(g, w) < 1e-12


def test_fused_tiles_pad_unequal_head_dims():
    """The CPU flash kernel takes one head dim; a narrower value is padded and its columns dropped."""
    from cp_compile.kernels.block import block_attn_backward_impl, block_attn_impl

    q, k, v, do = make_qkv(1, 4, 2, 9, 12, dv=8)
    want = sdpa_with_grads(q, k, v, do, is_causal=True)
    out, lse = block_attn_impl(q, k, v, "causal", 12**-0.5)
    grads = block_attn_backward_impl(do, q, k, v, out, lse, "causal", 12**-0.5, None)
    assert out.shape == q.shape[:3] + (8,) and grads[2].shape == v.shape
    for g, w in zip((out, *grads), want):
        assert max_err(g, w) < 1e-12


def test_positions_attention_with_chunks_and_cap():
    from cp_compile.kernels.masked import EMPTY_POSITION, positions_attn

    q, k, v, _ = make_qkv(1, 4, 2, 3, 8, dv=6)
    q_pos, k_pos = torch.tensor([5, 8, 9]), torch.tensor([0, 4, 7, 8, EMPTY_POSITION])
    k, v = k[:, :, :3].repeat(1, 1, 2, 1)[:, :, :5], v[:, :, :3].repeat(1, 1, 2, 1)[:, :, :5]
    out, lse = positions_attn(q, k, v, q_pos, k_pos, -1, 0.3, chunk=4, softcap=2.0)
    visible = (q_pos[:, None] >= k_pos[None, :]) & (q_pos[:, None] // 4 == k_pos[None, :] // 4)
    s = torch.tanh(torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.3 / 2.0) * 2.0
    s = s.masked_fill(~visible, float("-inf"))
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    assert max_err(out, want) < 1e-12
    assert torch.allclose(lse, torch.logsumexp(s, -1))
