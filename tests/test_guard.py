"""Inside ``with plan:`` no route runs plain attention on a shard: each raises LocalAttentionError on every rank.

Each route is one way plain attention can reach a kernel while the inputs are
shards: run eagerly, left to Dynamo's eager fallback (torch._dynamo.disable, the
recompile limit), or
compiled by a backend other than ``plan.backend()``. The correct paths (the CP
ops called eagerly, ``plan.backend()``) keep running, and give the
one-device result.
"""

import pytest
import torch
import torch.nn.functional as F

SEQ, HEADS, DIM = 16, 2, 8


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@torch._dynamo.disable
def _sdpa_not_traced(q, k, v):
    return _sdpa(q, k, v)


def _sdpa_after_break(q, k, v):
    print(end="")  # a graph break inside the function that holds the call
    return _sdpa(q, k, v)


def _varlen(q, k, v):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    t = [x[0].transpose(0, 1) for x in (q, k, v)]
    return varlen_attn(*t, cu, cu, q.shape[2], q.shape[2], window_size=(-1, 0))


def _flex(q, k, v):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v)


def _run_route(route: str, plan, q):
    """Runs ``route`` inside the plan; returns the output where the route is a correct one."""
    import cp_compile

    if route == "eager sdpa":
        return _sdpa(q, q, q)
    if route == "eager varlen":
        return _varlen(q, q, q)
    if route == "eager flex":
        return _flex(q, q, q)
    if route == "cp op eager":
        return plan.attention(q, q, q, is_causal=True)
    if route == "plan.backend()":
        return torch.compile(lambda x: _sdpa(x.sin(), x, x), backend=plan.backend("aot_eager"), fullgraph=True)(q)
    if route == "unflatten":  # a Python-level Tensor method the guard hands Dynamo as a method call

        def unflattened(x):
            return _sdpa(x.sin().flatten(2).unflatten(2, x.shape[2:]), x, x)

        return torch.compile(unflattened, backend=plan.backend("aot_eager"), fullgraph=True)(q)
    if route == "aot_eager backend":
        return torch.compile(lambda x: _sdpa(x.sin(), x, x), backend="aot_eager")(q)
    if route == "torch._dynamo.disable":
        return torch.compile(lambda x: _sdpa_not_traced(x.sin(), x, x), backend=plan.backend("aot_eager"))(q)
    if route == "graph break":
        return torch.compile(lambda x: _sdpa_after_break(x.sin(), x, x), backend=plan.backend("aot_eager"))(q)
    if route == "recompile limit":
        compiled = torch.compile(lambda x: _sdpa(x.sin(), x, x), backend=plan.backend("aot_eager"))
        with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
            compiled(q)  # compiled and rewritten: exact
            return compiled(q[:, :, : q.shape[2] // 2].contiguous())  # a second shape: over the limit, eager
    raise AssertionError(route)
    del cp_compile


def route_outcome(route: str):
    """(error message or None, error of the output against one device or None), on this rank."""
    import cp_compile

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    q_full = torch.randn(1, HEADS, SEQ, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = plan.shard(q_full, 2)
    try:
        with plan:
            out = _run_route(route, plan, q)
    except cp_compile.LocalAttentionError as e:
        return str(e), None
    ref = plan.shard(_sdpa(q_full if route == "cp op eager" else q_full.sin(), q_full, q_full), 2)
    return None, (out - ref).abs().max().item()


REFUSED = ["eager sdpa", "eager varlen", "eager flex", "aot_eager backend", "torch._dynamo.disable", "recompile limit"]


@pytest.mark.parametrize("route", REFUSED)
def test_plain_attention_on_a_shard_raises_on_every_rank(ranks, route):
    messages = [message for message, _ in ranks(2, route_outcome, route)]
    assert all(m is not None for m in messages), messages
    assert messages[0] == messages[1]
    assert "shard of the sequence alone" in messages[0] and "plan.backend()" in messages[0]
    if route == "aot_eager backend":
        assert "backend other than plan.backend()" in messages[0]
    elif route != "eager flex":  # eager FlexAttention compiles itself, with another backend
        assert "ran eagerly" in messages[0]


# a graph break inside the function that holds the call: Dynamo compiles the rest of that function as a
# graph of its own, with the same backend, which rewrites the call
@pytest.mark.parametrize("route", ["cp op eager", "plan.backend()", "graph break", "unflatten"])
def test_correct_paths_run_under_the_guard(ranks, route):
    for message, error in ranks(2, route_outcome, route):
        assert message is None and error < 1e-12, (message, error)


def _guards() -> int:
    from torch.overrides import _get_current_function_mode_stack

    from cp_compile.guard import LocalAttentionGuard

    return sum(isinstance(m, LocalAttentionGuard) for m in _get_current_function_mode_stack())


def test_guard_lives_and_leaves_with_the_plan():
    """The guard is on inside the plan only: outside it, plain attention is the user's own business."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cp_compile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan = cp_compile.ContextParallel()
        q = torch.randn(1, HEADS, SEQ, DIM)
        with plan:
            assert _guards() == 1
            with pytest.raises(cp_compile.LocalAttentionError):
                _sdpa(q, q, q)
        assert _guards() == 0
        with pytest.raises(RuntimeError, match="boom"), plan:  # an exception leaves the plan too
            raise RuntimeError("boom")
        assert _guards() == 0
        assert _sdpa(q, q, q).shape == q.shape  # runs: no error outside the plan
    finally:
        dist.destroy_process_group()
