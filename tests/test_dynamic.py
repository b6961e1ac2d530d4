"""One compile for every batch: a compiled region meets a new split or length on every step and compiles at
most twice (the first shape, then one dynamic graph), exact against one device on every step.

The Hugging Face and torchtitan integrations have the same check in their own test files.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import max_err, varlen_gqa
from test_varlen import per_document_reference

BUDGET = 48  # tokens per step, packed into random documents


def random_lengths(gen: torch.Generator, budget: int, max_docs: int = 6) -> list[int]:
    """1..max_docs documents of random lengths (none empty) that fill ``budget`` tokens."""
    n = int(torch.randint(1, max_docs + 1, (1,), generator=gen))
    cuts = sorted((torch.randperm(budget - 1, generator=gen)[: n - 1] + 1).tolist())
    bounds = [0] + cuts + [budget]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def packed_splits(inner: str, steps: int, window: tuple[int, int]):
    """``steps`` random packings through one compiled varlen model; per step its compile count and error."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.varlen import varlen_attn

    import cp_compile

    torch._dynamo.reset()
    counters.clear()
    plan = cp_compile.ContextParallel()
    backend = plan.backend(inner)

    gqa = varlen_gqa()

    def model(q, k, v, cu):
        return varlen_attn(q.sin(), k, v, cu, cu, BUDGET, BUDGET, window_size=window, **gqa)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    graphs, errors, slots = [], [], []
    for _ in range(steps):
        lengths = random_lengths(gen, BUDGET)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q, k, v, do = (torch.randn(BUDGET, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
        ref = per_document_reference(q.sin(), k, v, do, cu, window)
        local = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
        with plan:
            out = compiled(*local, cu)
            out.backward(plan.shard(do, 0, cu_seqlens=cu))
        grads = [local[0].grad.detach()] + [t.grad for t in local[1:]]
        # q's reference gradient is the sin's input's gradient: chain through cos
        ref_grads = [ref[1] * q.cos(), ref[2], ref[3]]
        errors.append(
            max(
                [max_err(out, plan.shard(ref[0], 0, cu_seqlens=cu))]
                + [max_err(g, plan.shard(r, 0, cu_seqlens=cu)) for g, r in zip(grads, ref_grads)]
            )
        )
        graphs.append(len(backend.records))
        slots.append(out.shape[0])
    return graphs, errors, slots, sum(counters["graph_break"].values())


@pytest.mark.parametrize("world_size,inner,window", [(2, "inductor", (-1, 0)), (3, "aot_eager", (5, 0))])
def test_packed_splits_compile_at_most_twice(ranks, world_size, inner, window):
    for graphs, errors, slots, breaks in ranks(world_size, packed_splits, inner, 100, window, timeout=900):
        assert breaks == 0
        assert len(set(slots)) > 3  # the slot count did change from step to step
        assert graphs[-1] <= 2, graphs
        assert max(errors) < 1e-10, max(errors)


def causal_lengths(inner: str, lengths: list[int]):
    """A causal SDPA model over sequences of changing length: compile count and error per step."""
    from torch._dynamo.utils import counters

    import cp_compile

    torch._dynamo.reset()
    counters.clear()
    plan = cp_compile.ContextParallel()
    backend = plan.backend(inner)
    compiled = torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q.sin(), k, v, is_causal=True), backend=backend, fullgraph=True
    )
    gen = torch.Generator().manual_seed(6)
    graphs, errors = [], []
    for seq in lengths:
        q, k, v = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.sin(), k, v, is_causal=True)
        with plan:
            out = compiled(*(plan.shard(t, 2) for t in (q, k, v)))
        errors.append(max_err(out, plan.shard(ref, 2)))
        graphs.append(len(backend.records))
    return graphs, errors, sum(counters["graph_break"].values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_causal_lengths_compile_at_most_twice(ranks, world_size):
    lengths = [2 * world_size * n for n in (8, 5, 11, 3, 16, 7, 9, 4)]  # any length the zigzag layout accepts
    for graphs, errors, breaks in ranks(world_size, causal_lengths, "inductor", lengths, timeout=600):
        assert breaks == 0
        assert graphs[-1] <= 2, graphs
        assert max(errors) < 1e-10, max(errors)


def flex_documents(inner: str, steps: int):
    """A FlexAttention document mask built anew every step (forward: CPU flex takes no grads under Dynamo)."""
    from test_flex import reference
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import cp_compile
    from cp_compile import masks

    torch._dynamo.reset()
    counters.clear()
    plan = cp_compile.ContextParallel()
    seq = 8 * plan.world_size
    backend = plan.backend(inner)
    compiled = torch.compile(
        lambda q, k, v, bm: flex_attention(q.sin(), k, v, block_mask=bm, scale=0.3), backend=backend, fullgraph=True
    )
    gen = torch.Generator().manual_seed(7)
    graphs, errors = [], []
    for _ in range(steps):
        doc = torch.repeat_interleave(torch.tensor(random_lengths(gen, seq)))
        mask_mod = masks.and_(masks.causal(), masks.document(doc))
        block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=4)
        q, k, v = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        ref = reference(q.sin(), k, v, torch.zeros_like(q), mask_mod, None, 0.3)[0]
        with plan:
            out = compiled(*(plan.shard(t, 2) for t in (q, k, v)), plan.shard(block_mask))
        errors.append(max_err(out, plan.shard(ref, 2)))
        graphs.append(len(backend.records))
    return graphs, errors, sum(counters["graph_break"].values())


def test_flex_document_masks_compile_at_most_twice(ranks):
    for graphs, errors, breaks in ranks(2, flex_documents, "aot_eager", 30, timeout=600):
        assert breaks == 0
        assert graphs[-1] <= 2, graphs
        assert max(errors) < 1e-10, max(errors)


def test_random_lengths_fill_the_budget():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = random_lengths(gen, BUDGET)
        assert sum(lengths) == BUDGET and min(lengths) > 0 and 1 <= len(lengths) <= 6
