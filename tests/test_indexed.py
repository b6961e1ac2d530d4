"""Indexed sparse attention (DSA) under CP (``cp_compile.mixers.indexed``) on real gloo ranks against one process.

An indexer of its own (one head of index keys, scores masked causally within documents, the top k) and the sparse
attention over the keys it chose, fp64, C = 1 to 4, zigzag, contiguous and packed documents (lengths 1 and 0, a
top k longer than a document): the chosen keys, the output, its log-sum-exp, and the gradients of queries, keys and
values (of the output and of the log-sum-exp, which attention sinks read).
"""

import pytest
import torch
from test_mixers import LAYOUTS, _errors, _setup, _shard

TOP_K = 5


def _visible(total: int, cu) -> torch.Tensor:
    """[T, T] causal within documents, as one process masks the whole sequence."""
    place = torch.arange(total)
    doc = torch.zeros(total, dtype=torch.long) if cu is None else torch.searchsorted(cu, place, right=True)
    return (place[None, :] <= place[:, None]) & (doc[None, :] == doc[:, None])


def _chosen(index_q, index_k, visible) -> torch.Tensor:
    """[B, Lq, T] bool: the top k of each query's visible keys by the indexer's score (fewer where fewer precede)."""
    scores = torch.matmul(index_q, index_k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    top = scores.topk(min(TOP_K, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & visible, top


def _attend(q, k, v, allowed):
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (torch.matmul(q, k.transpose(-1, -2)) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    return torch.matmul(scores.softmax(-1), v), scores.logsumexp(-1)


def indexed_case(layout_name):
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.indexed import gather_index_keys, indexed_attention, indexer_mask

    plan, cu, total = _setup(layout_name)
    torch.manual_seed(0)
    b, hq, hkv, d, dv, di = 2, 4, 2, 8, 6, 5
    q = torch.randn(b, hq, total, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, total, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, total, dv, dtype=torch.float64, requires_grad=True)
    index_q, index_k = torch.randn(b, total, di, dtype=torch.float64), torch.randn(b, total, di, dtype=torch.float64)
    dy, dlse = torch.randn(b, hq, total, dv, dtype=torch.float64), torch.randn(b, hq, total, dtype=torch.float64)
    visible = _visible(total, cu)
    chosen, _ = _chosen(index_q, index_k, visible)
    ref, ref_lse = _attend(q, k, v, chosen)
    torch.autograd.backward([ref, ref_lse], [dy, dlse])  # the lse's gradient: attention sinks fold it in

    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    local_q = _shard(plan, index_q, 1, cu)
    every_k = gather_index_keys(_shard(plan, index_k, 1, cu), sharding)
    local_chosen, top = _chosen(local_q, every_k, indexer_mask(local_q, total, sharding))
    qs, ks, vs = (_shard(plan, t.detach(), 2, cu).requires_grad_() for t in (q, k, v))
    out, lse = indexed_attention(qs, ks, vs, top, sharding, 0.3)
    torch.autograd.backward([out, lse], [_shard(plan, dy, 2, cu), _shard(plan, dlse, 2, cu)])
    chosen_differs = float((local_chosen != _shard(plan, chosen, 1, cu)).sum())
    pairs = [(out.detach(), ref.detach(), 2), (lse.detach(), ref_lse.detach(), 2)]
    pairs += [(qs.grad, q.grad, 2), (ks.grad, k.grad, 2), (vs.grad, v.grad, 2)]
    return [chosen_differs, float(every_k.shape[1] != total), *_errors(plan, pairs, cu)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_indexed_attention_fp64_equals_one_process(ranks, world_size):
    """The keys each query chose, the output, and the gradients of q, k and v (every rank's share of the keys' and
    values' gradients summed back to the rank that holds them) to 1e-10, every layout."""
    for layout in LAYOUTS:
        for errs in ranks(world_size, indexed_case, layout):
            assert errs[:2] == [0.0, 0.0] and max(errs[2:]) < 1e-10, (layout, errs)


@pytest.mark.parametrize("route", ["gathered", "masked"])
def test_picked_attention_by_either_route_is_dense_attention_over_the_picks(route, monkeypatch):
    """``kernels.sparse.picked_attention`` against dense attention masked to each row's usable picks, fp64, GQA, by
    each route forced: places picked twice (counted once, usable if either pick is), picks a row may not see, a row
    with none usable (out 0, lse -inf, no gradient through it), in blocks of rows (a tiny block bound)."""
    from cp_compile.kernels import sparse

    monkeypatch.setattr(sparse, "_GATHER_BELOW", 0 if route == "gathered" else 10**9)
    monkeypatch.setattr(sparse, "_BLOCK_ELEMENTS", 700)
    torch.manual_seed(3)
    b, hq, hkv, rows, total, d, dv, n = 2, 4, 2, 9, 30, 8, 6, 7
    q = torch.randn(b, hq, rows, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, total, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, total, dv, dtype=torch.float64, requires_grad=True)
    picks = torch.randint(0, total, (b, rows, n))
    picks[:, :, 1] = picks[:, :, 0]  # every row picks a place twice
    usable = torch.rand(b, rows, n) < 0.7
    usable[:, :, 0], usable[:, :, 1] = False, True  # ... usable by its second pick alone
    usable[0, 4] = False  # a row that sees nothing
    allowed = torch.zeros(b, rows, total, dtype=torch.bool)
    for i in range(n):
        allowed |= torch.nn.functional.one_hot(picks[..., i], total).bool() & usable[..., i, None]
    seen = allowed.any(-1)[:, None, :, None]  # [B, 1, rows, 1]
    # the reference's empty row sees key 0 instead (softmax over nothing is NaN) and no gradient reaches it
    ref, ref_lse = _attend(q, k, v, allowed | ~allowed.any(-1, keepdim=True) & (torch.arange(total) == 0))
    dy, dlse = torch.randn_like(ref) * seen, torch.randn_like(ref_lse) * seen[..., 0]
    want = torch.autograd.grad([ref, ref_lse], (q, k, v), [dy, dlse])

    out, lse = sparse.picked_attention(q, k, v, picks, usable, 0.3)
    got = torch.autograd.grad([out, lse], (q, k, v), [dy, dlse])
    assert torch.isneginf(lse[0, :, 4]).all() and (out[0, :, 4] == 0).all()
    assert (torch.where(seen, out - ref, 0)).abs().max() < 1e-12
    assert (torch.where(seen[..., 0], lse - ref_lse, 0)).abs().max() < 1e-12
    for a, w in zip(got, want, strict=True):
        assert (a - w).abs().max() < 1e-12
