"""Checkpointing never re-runs the forward ring (SAC policy eager and compiled; plain checkpoint compiled)."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from cp_compile.sac import sac_policy


def checkpointed_traffic(mode: str, compiled: bool, inner: str = "aot_eager", budget: float = 1.0):
    """fp64 attention block under checkpoint: backward traffic by tag and gradient error.

    ``budget`` is ``torch._functorch.config.activation_memory_budget`` while compiling."""
    import torch.nn.functional as F
    from helpers import make_qkv, max_err
    from torch._functorch import config as functorch_config
    from torch.utils.checkpoint import checkpoint

    import cp_compile
    from cp_compile.sac import sac_context

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel(schedule="ring")  # the ring's graphs and traffic are what is checked
    q, k, v, _ = make_qkv(1, 4, 2, 6 * plan.world_size, 8)

    def block(attention, q, k, v):
        return attention(q.sin(), k * 2, v).cos()

    def fn(attention, q, k, v):
        kwargs = {"context_fn": sac_context()} if mode == "sac" else {}
        if mode == "none":
            return block(attention, q, k, v)
        return checkpoint(block, attention, q, k, v, use_reentrant=False, **kwargs)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    block(sdpa, *ref).sum().backward()
    local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    if compiled:
        with functorch_config.patch(activation_memory_budget=budget):
            out = torch.compile(lambda *a: fn(sdpa, *a), backend=plan.backend(inner), fullgraph=True)(*local)
    else:
        eager = lambda q, k, v: cp_compile.ring_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        out = fn(eager, *local)
    with cp_compile.count_traffic() as backward:
        out.sum().backward()
    err = max(max_err(a.grad, plan.shard(b.grad, 2)) for a, b in zip(local, ref))
    return backward.by_tag, err


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sac_backward_sends_no_forward_ring(ranks, world_size, compiled):
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for by_tag, err in ranks(world_size, checkpointed_traffic, "sac", compiled, timeout=300):
        assert err < 1e-10
        # the backward ring alone: K/V C-1 times, dK/dV C times
        assert by_tag == {TAG_KV: world_size - 1, TAG_DKV: world_size}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_plain_checkpoint_compiled_does_not_rerun_the_ring(ranks, inner):
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for by_tag, err in ranks(2, checkpointed_traffic, "plain", True, inner, timeout=600):
        assert err < 1e-10
        assert by_tag == {TAG_KV: 1, TAG_DKV: 2}


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_activation_memory_budget_never_recomputes_the_ring(ranks, budget):
    """Under a budget the min-cut partitioner ignores MUST_SAVE tags (budget 0 saves only inputs);
    the CP partitioner splits again with the CP outputs saved."""
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for by_tag, err in ranks(2, checkpointed_traffic, "none", True, "inductor", budget, timeout=600):
        assert err < 1e-10
        assert by_tag == {TAG_KV: 1, TAG_DKV: 2}


def test_plain_checkpoint_reruns_the_ring_in_eager_mode(ranks):
    """Documented: without a policy, eager checkpoint recomputes the forward, ring included."""
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for by_tag, err in ranks(2, checkpointed_traffic, "plain", False):
        assert err < 1e-10
        assert by_tag == {TAG_KV: 2, TAG_DKV: 2}


def test_policy_saves_cp_ops_and_defers_to_the_users_policy():
    calls = []

    def users_policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return CheckpointPolicy.MUST_RECOMPUTE

    policy = sac_policy(users_policy)
    for op in (torch.ops.cp.ring_attention.default, torch.ops.cp.block_attn.default):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.sin.default) == CheckpointPolicy.MUST_RECOMPUTE
    assert calls == [torch.ops.aten.sin.default]
    default = sac_policy()
    assert default(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_SAVE
    assert default(None, torch.ops.aten.sin.default) == CheckpointPolicy.PREFER_RECOMPUTE


def stale_input(use_sac: bool):
    """An input changed in place after the forward: backward must refuse, not use stale data."""
    from helpers import make_qkv
    from torch.utils.checkpoint import checkpoint

    import cp_compile
    from cp_compile.sac import sac_context

    q, k, v, _ = make_qkv(1, 2, 2, 8, 8)
    leaf = q.clone().requires_grad_()
    x = leaf * 1.0  # a non-leaf, which may be changed in place

    def block(x):
        return cp_compile.ring_attention(x, k, v, is_causal=True)

    out = checkpoint(block, x, use_reentrant=False, context_fn=sac_context()) if use_sac else block(x)
    with torch.no_grad():
        x.add_(1.0)
    try:
        out.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("use_sac", [False, True], ids=["plain", "sac"])
def test_input_changed_after_forward_is_caught(ranks, use_sac):
    for message in ranks(2, stale_input, use_sac):
        assert message is not None and "modified by an inplace operation" in message
