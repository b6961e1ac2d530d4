"""The cost model: per-schedule estimates, the choice, its explanation, and the same choice on every rank."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import cp_compile
from cp_compile.passes.cost import (
    ESTIMATORS, MACHINES, SCHEDULES, Machine, Workload, estimate_all, pick,
)
from cp_compile.passes.expand import expand_cp_ops
from cp_compile.passes.order import schedule_listing


def workload(c=4, hq=32, hkv=8, s_local=4096, d=128, dtype=torch.bfloat16, causal=True, mesh=(), backward=True):
    return Workload(1, hq, hkv, s_local, d, d, dtype, c, 0.5 if causal else 1.0, causal, backward, mesh)


def test_every_schedule_has_an_estimator():
    assert set(SCHEDULES) == set(ESTIMATORS)


def test_ulysses_infeasible_when_heads_do_not_split():
    rows = {e.schedule: e for e in estimate_all(workload(c=3, hq=8, hkv=8), MACHINES["cuda"])}
    assert not rows["ulysses"].feasible and "8 query heads do not split over 3 ranks" in rows["ulysses"].reason
    assert not rows["hybrid"].feasible and "2-D mesh" in rows["hybrid"].reason
    assert rows["ring"].feasible


def test_kv_replication_is_noted():
    rows = {e.schedule: e for e in estimate_all(workload(c=4, hq=8, hkv=2), MACHINES["cuda"])}
    assert rows["ulysses"].feasible and any("replicated x2 (2 -> 4)" in n for n in rows["ulysses"].notes)


def test_choices_follow_the_regimes():
    gpu = MACHINES["cuda"]
    # long local sequence: compute hides the ring's transfers; Ulysses' exposed all-to-alls cost more
    assert pick(estimate_all(workload(c=2, s_local=16384), gpu)).schedule == "ring"
    # short local sequence at large C: the ring's C-1 transfers are exposed; one all-to-all wins
    assert pick(estimate_all(workload(c=8, hkv=32, s_local=256), gpu)).schedule == "ulysses"
    # few K/V heads (GQA 32/8): gathering K/V moves less than exchanging q, k, v and out
    assert pick(estimate_all(workload(c=8, s_local=256), gpu)).schedule == "allgather"
    # large C, heads that do not split over C but split over the all-to-all dim of a mesh: hybrid
    est = estimate_all(workload(c=16, hq=8, hkv=8, s_local=512, mesh=(2, 8)), gpu)
    assert pick(est).schedule == "hybrid"
    # a memory limit rules candidates out, and says so
    tight = Machine("cuda", 400e12, 150e9, 15e-6, memory_limit=1.0)
    with pytest.raises(ValueError, match="over the limit"):
        pick(estimate_all(workload(), tight))


def test_choice_is_deterministic_and_prefers_the_earlier_name_on_ties():
    w = workload(c=1)
    first = [e.schedule for e in estimate_all(w, MACHINES["cpu"])]
    assert first == [e.schedule for e in estimate_all(w, MACHINES["cpu"])]
    assert pick(estimate_all(w, MACHINES["cpu"], available={"ring", "ulysses"})).schedule == "ring"


@pytest.fixture
def fake_group(request):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param, dist.group.WORLD.group_name
    dist.destroy_process_group()


def traced(fn, *shapes):
    with FakeTensorMode():
        return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes])


@pytest.mark.parametrize("fake_group", [2, 4], indirect=True)
def test_ulysses_graph_holds_no_rank(fake_group):
    c, name = fake_group

    def forward(q, k, v):
        return torch.ops.cp.ulysses_attention(q, k, v, [], name, True, "zigzag", 0.25, True, "sdpa", "")[0]

    gm = traced(forward, (1, 8, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    (expansion,) = expand_cp_ops(gm.graph)
    # agree, q/k/v in (K/V heads replicated x2 at C=4), attention, out and lse back
    assert schedule_listing(gm.graph) == ["agree"] + ["all_to_all", "wait"] * 3 + ["heads_attend"] + \
        ["all_to_all", "wait"] * 2
    for node in gm.graph.nodes:
        if node.target == torch.ops._c10d_functional.all_to_all_single.default:
            assert node.args[1] == node.args[2] == [1] * c and node.args[3] == name


def calibrated_machine():
    plan = cp_compile.ContextParallel(calibrate=True)
    return plan.machine


def test_calibration_gives_every_rank_the_same_profile(ranks):
    machines = ranks(2, calibrated_machine)
    assert machines[0] == machines[1]  # max-reduced over the group: the choice cannot differ by rank
    m = machines[0]
    assert m.source == "calibrated" and m.flops > 0 and m.bandwidth > 0 and m.latency > 0
