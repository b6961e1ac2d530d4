"""The all-gather schedule for SDPA: eager on gloo ranks, opcheck, graph shape, compiled."""

import pytest
import torch
import torch.distributed as dist
from helpers import make_qkv, max_err, sdpa_with_grads
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

# (B, Hq, Hkv, S per rank, D, causal, layout)
CONFIGS = [
    (2, 4, 2, 8, 16, True, "zigzag"),
    (1, 3, 3, 6, 10, False, "zigzag"),
    (2, 2, 1, 4, 8, True, "contiguous"),
    (1, 6, 2, 5, 12, False, "contiguous"),
]


def run_allgather_configs():
    """Every config on every rank: fp64 CP out/dq/dk/dv errors against single-device SDPA."""
    import cp_compile

    results = []
    for b, hq, hkv, s_local, d, causal, layout in CONFIGS:
        plan = cp_compile.ContextParallel(load_balance=layout, schedule="allgather")
        q, k, v, do = make_qkv(b, hq, hkv, s_local * plan.world_size, d)
        reference = sdpa_with_grads(q, k, v, do, is_causal=causal)
        leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
        with cp_compile.count_traffic() as traffic:
            out = plan.attention(*leaves, is_causal=causal, enable_gqa=hq != hkv)
            out.backward(plan.shard(do, 2))
        got = [out.detach()] + [t.grad for t in leaves]
        results.append(
            {
                "errors": [max_err(g, plan.shard(r, 2)) for g, r in zip(got, reference)],
                "nan": any(torch.isnan(g).any().item() for g in got),
                "ring_shifts": traffic.shifts,
            }
        )
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp64_equals_single_device(ranks, world_size):
    for per_rank in ranks(world_size, run_allgather_configs):
        for config, result in zip(CONFIGS, per_rank):
            assert not result["nan"], config
            assert max(result["errors"]) < 1e-10, (config, result["errors"])
            assert result["ring_shifts"] == 0  # collectives only, no point-to-point ring


def low_precision(dtype_name: str):
    import cp_compile

    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel(schedule="allgather")
    q, k, v, do = make_qkv(1, 4, 2, 96, 32, seed=1)
    reference = sdpa_with_grads(q, k, v, do, is_causal=True)
    single = sdpa_with_grads(*(t.to(dtype) for t in (q, k, v, do)), is_causal=True)
    leaves = [plan.shard(t.to(dtype), 2).requires_grad_() for t in (q, k, v)]
    out = plan.attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(plan.shard(do.to(dtype), 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return [
        (max_err(g, plan.shard(r, 2)), max_err(plan.shard(s, 2), plan.shard(r, 2)))
        for g, s, r in zip(got, single, reference)
    ]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_low_precision_within_twice_single_device_error(ranks, dtype):
    for per_rank in ranks(3, low_precision, dtype):
        for name, (cp, single) in zip(("out", "dq", "dk", "dv"), per_rank):
            assert cp <= 2 * single, f"{name}: CP error {cp:.3g} vs single-device {single:.3g}"


def opcheck_allgather_ops():
    import cp_compile  # noqa: F401

    name = dist.group.WORLD.group_name
    q, k, v, do = make_qkv(1, 2, 1, 8, 6)
    out, lse = torch.ops.cp.allgather_attention(q, k, v, [], name, True, "zigzag", 0.4, True, "sdpa", "")
    k_all, v_all = (torch.cat([t] * dist.get_world_size(), 2) for t in (k, v))
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]
    gathered = ("sdpa", -1, name, 1, True, "zigzag", 0.4, "")
    cases = [
        (torch.ops.cp.allgather_attention.default, (*req(q, k, v), [], name, True, "zigzag", 0.4, True, "sdpa", "")),
        (
            torch.ops.cp.allgather_attention_backward.default,
            (do, q, k, v, out, lse, None, [], name, True, "zigzag", 0.4, "sdpa", ""),
        ),
        (torch.ops.cp.attend.default, (q, k_all, v_all, [], *gathered)),
        (torch.ops.cp.attend_backward.default, (do, q, k_all, v_all, out, lse, lse.clone(), [], *gathered)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    return True


def test_opcheck_allgather_ops(ranks):
    assert ranks(2, opcheck_allgather_ops) == [True, True]


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def test_expanded_graph_gathers_and_reduce_scatters(fake_group):
    from cp_compile.compiler.expand import expand_cp_ops
    from cp_compile.compiler.order import schedule_listing

    name = fake_group
    fc = torch.ops._c10d_functional

    def both(q, k, v, do):
        out, lse = torch.ops.cp.allgather_attention(q, k, v, [], name, True, "zigzag", 0.25, True, "sdpa", "")
        grads = torch.ops.cp.allgather_attention_backward(
            do, q, k, v, out, lse, None, [], name, True, "zigzag", 0.25, "sdpa", ""
        )
        return out, grads

    with FakeTensorMode():
        shapes = [(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), (1, 4, 8, 16)]
        gm = make_fx(both, tracing_mode="fake")(*(torch.empty(s) for s in shapes))
    forward, backward = expand_cp_ops(gm.graph)
    assert forward.count(fc.all_gather_into_tensor.default) == 1  # K and V side by side, once
    assert backward.count(fc.all_gather_into_tensor.default) == 1  # gathered again, not saved
    assert backward.count(fc.reduce_scatter_tensor.default) == 1  # dK and dV home together
    assert forward.count(torch.ops.cp.ring_shift.default) == 0
    gm.recompile()
    assert schedule_listing(gm.graph) == (
        ["agree", "gather", "wait", "gathered attend"]
        + ["gather", "wait", "gathered attend_backward"]
        + ["reduce_scatter", "wait"]
    )
    for node in forward.nodes + backward.nodes:  # the group size and name, never the rank
        if node.target in (fc.all_gather_into_tensor.default, fc.reduce_scatter_tensor.default):
            assert node.args[-2:] == (3, name)


@pytest.mark.parametrize("tracing", ["fake", "symbolic"])
def test_a_graph_agrees_once_where_later_sizes_follow(fake_group, tracing):
    """Three sites: the second has the first's sizes, the third sizes of its own. Static sizes: one agreement,
    carrying a digest of all three; symbolic sizes: the third keeps its own (its symbol was not compared)."""
    from cp_compile.compiler.expand import expand_cp_ops

    name = fake_group

    def site(q, k, v):
        return torch.ops.cp.allgather_attention(q, k, v, [], name, True, "zigzag", 0.25, True, "sdpa", "")[0]

    def three(q, k, v, q2, k2, v2):
        first = site(q, k, v)
        return site(first, k, v), site(q2, k2, v2)

    shapes = [(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), (1, 4, 6, 16), (1, 2, 6, 16), (1, 2, 6, 16)]
    gm = make_fx(three, tracing_mode=tracing)(*(torch.randn(s) for s in shapes))  # traced on fake tensors
    expand_cp_ops(gm.graph)
    agrees = [n for n in gm.graph.nodes if n.target == torch.ops.cp.agree.default]
    assert len(agrees) == (1 if tracing == "fake" else 2)
    assert "graph_sites=3:" in agrees[0].args[4]
    assert sum(1 for n in gm.graph.nodes if n.target == torch.ops.cp.attend.default) == 3


def compiled_parity(inner: str):
    import torch.nn.functional as F

    import cp_compile

    plan = cp_compile.ContextParallel(schedule="allgather")
    q, k, v, do = make_qkv(2, 6, 2, 12 * plan.world_size, 10)

    def attention(q, k, v):
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.3)
        b = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return a * b

    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*ref_inputs).backward(do)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    backend = plan.backend(inner)
    out = torch.compile(attention, backend=backend, fullgraph=True)(*local)
    out.backward(plan.shard(do, 2))
    errs = [max_err(out, plan.shard(attention(q, k, v), 2))]
    errs += [max_err(a.grad, plan.shard(b.grad, 2)) for a, b in zip(local, ref_inputs)]
    schedules = [s.decision.schedule for r in backend.records for s in r.sites]
    return errs, schedules, sum(counters["graph_break"].values())


@pytest.mark.parametrize("inner", ["inductor"])
def test_compiled_allgather_matches_single_device(ranks, inner):
    for errs, schedules, breaks in ranks(3, compiled_parity, inner, timeout=600):
        assert breaks == 0
        assert schedules == ["allgather", "allgather"]
        assert max(errs) < 1e-10, errs
