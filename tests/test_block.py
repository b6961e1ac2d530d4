"""Block attention and the merge, against a dense fp64 reference (single process)."""

import pytest
import torch
from helpers import max_err

import cp_compile  # noqa: F401  (registers torch.ops.cp)
from cp_compile.kernels.block import MASKS


def visible_mask(lq, lk, mask):
    i = torch.arange(lq).unsqueeze(1)
    j = torch.arange(lk).unsqueeze(0)
    return {
        "none": torch.ones(lq, lk, dtype=torch.bool),
        "causal": j <= i,
        "causal_bottom_right": j <= i + (lk - lq),
        "empty": torch.zeros(lq, lk, dtype=torch.bool),
    }[mask]


def dense_attention(q, k, v, visible, scale):
    """Differentiable reference; rows that see nothing give out=0, lse=-inf, zero grads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seen = visible.any(-1)
    keep = visible | ~seen.unsqueeze(-1)  # fully masked rows: finite dummy scores, zeroed below
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v * seen.unsqueeze(-1)
    return out, torch.where(seen, lse * seen, torch.full_like(lse, float("-inf")))


def inputs(lq, lk, hq=4, hkv=2, d=10, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
    return mk(2, hq, lq, d), mk(2, hkv, lk, d), mk(2, hkv, lk, d), mk(2, hq, lq, d), mk(2, hq, lq)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lq,lk", [(8, 8), (5, 12), (12, 5), (1, 7)])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_block_attn_matches_dense_fp64(mask, lq, lk, heads):
    q, k, v, do, dlse = inputs(lq, lk, *heads)
    scale = 0.37
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.cp.block_attn(*leaves, mask, scale)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_attention(*ref_leaves, visible_mask(lq, lk, mask), scale)
    assert lse.dtype == torch.float64
    assert max_err(out, ref_out) < 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert max_err(lse[finite], ref_lse[finite]) < 1e-12
    # lse is differentiated too: its gradient flows through the dlse path
    seen = finite.to(lse.dtype)
    (out * do).sum().backward(retain_graph=True)
    (torch.where(finite, lse, 0) * dlse * seen).sum().backward()
    ((ref_out * do).sum() + (torch.where(finite, ref_lse, 0) * dlse * seen).sum()).backward()
    for got, want in zip(leaves, ref_leaves):
        assert not torch.isnan(got.grad).any()
        assert max_err(got.grad, want.grad) < 1e-11


def test_empty_block_gives_zeros_not_nan():
    q, k, v, do, _ = inputs(6, 6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.cp.block_attn(*leaves, "empty", 0.5)
    out.backward(do)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    for t in leaves:
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_lse_is_fp32(dtype):
    q, k, v, _, _ = inputs(8, 8, dtype=dtype)
    out, lse = torch.ops.cp.block_attn(q, k, v, "causal", 0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32


def test_merge_of_two_halves_equals_whole():
    q, k, v, _, _ = inputs(7, 12)
    whole_out, whole_lse = torch.ops.cp.block_attn(q, k, v, "none", 0.4)
    a = torch.ops.cp.block_attn(q, k[:, :, :5], v[:, :, :5], "none", 0.4)
    b = torch.ops.cp.block_attn(q, k[:, :, 5:], v[:, :, 5:], "none", 0.4)
    out, lse = torch.ops.cp.merge(*a, *b)
    assert max_err(out, whole_out) < 1e-13 and max_err(lse, whole_lse) < 1e-13


def test_merge_fully_masked_rows_stay_zero():
    out = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    lse = torch.randn(1, 2, 4, dtype=torch.float64)
    lse[:, :, 1] = float("-inf")
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    m_out, m_lse = torch.ops.cp.merge(empty_out, empty_lse, out, lse)
    assert not torch.isnan(m_out).any() and not torch.isnan(m_lse).any()
    assert torch.equal(m_out[:, :, 1], torch.zeros_like(m_out[:, :, 1]))
    assert torch.isneginf(m_lse[:, :, 1]).all()
    assert max_err(m_out[:, :, 0], out[:, :, 0]) == 0.0


def test_merge_accumulates_in_fp32_for_bf16():
    out = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 4)
    m_out, m_lse = torch.ops.cp.merge(out.float(), lse, out, lse)
    assert m_out.dtype == torch.float32 and m_lse.dtype == torch.float32


def test_merge_gradients():
    g = torch.Generator().manual_seed(3)
    args = [
        torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 2, 3, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 2, 3, generator=g, dtype=torch.float64, requires_grad=True),
    ]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.cp.merge(*a), args)


def _opcheck_cases():
    q, k, v, do, dlse = inputs(6, 9)
    out, lse = torch.ops.cp.block_attn(q, k, v, "causal_bottom_right", 0.3)
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]
    yield torch.ops.cp.block_attn.default, (*req(q, k, v), "causal_bottom_right", 0.3)
    yield torch.ops.cp.block_attn.default, (*req(q, k, v), "none", 0.3)
    yield torch.ops.cp.block_attn_backward.default, (do, q, k, v, out, lse, "causal_bottom_right", 0.3, dlse)
    yield torch.ops.cp.block_attn_backward.default, (do, q, k, v, out, lse, "empty", 0.3, None)
    yield torch.ops.cp.merge.default, tuple(req(out, lse, out * 0.5, lse - 1.0))
    qf, kf, vf = (t.float() for t in (q, k, v))
    yield torch.ops.cp.block_attn.default, (*req(qf, kf, vf), "causal", 0.3)


@pytest.mark.parametrize("case", list(range(6)))
def test_opcheck(case):
    op, args = list(_opcheck_cases())[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("one_call", [True, False], ids=["one masked call", "tiles"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gathered_block_matches_dense_fp64(monkeypatch, one_call, layout, is_causal, world_size):
    """A rank's queries against every rank's keys (the all-gather schedule's one attend): out, lse, dQ and the
    rank's share of the full-length dK/dV, whether the block runs as one masked call or in tiles."""
    from cp_compile.kinds import sdpa
    from cp_compile.kinds.base import GATHERED, Units
    from cp_compile.kinds.call import Call
    from cp_compile.layout import layout_named

    if not one_call:
        monkeypatch.setattr(sdpa, "ONE_CALL_ENTRIES", 0)
    seq, scale = 8 * world_size, 0.37
    q, k, v, do, _ = inputs(seq, seq)
    for rank in range(world_size):
        rows = layout_named(layout).positions(seq, rank, world_size)
        units, call = Units(rank, world_size, 1, GATHERED), Call("sdpa", ("",), is_causal, layout, scale)
        q_local = q[:, :, rows].contiguous()
        out, lse = sdpa.gathered_attn(q_local, k, v, units, call)
        dq, dk, dv = sdpa.gathered_attn_backward(
            do[:, :, rows].contiguous(), q_local, k, v, out, lse, None, units, call
        )
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        visible = visible_mask(seq, seq, "causal" if is_causal else "none")
        ref_out, ref_lse = dense_attention(*leaves, visible, scale)
        (ref_out[:, :, rows] * do[:, :, rows]).sum().backward()
        assert max_err(out, ref_out[:, :, rows]) < 1e-12
        assert max_err(lse, ref_lse[:, :, rows]) < 1e-12
        for got, ref in zip((dq, dk, dv), (leaves[0].grad[:, :, rows], leaves[1].grad, leaves[2].grad)):
            assert max_err(got, ref) < 1e-12
