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
