"""Graph structure of the expanded ring, on a fake process group (no data moves)."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import cp_compile  # noqa: F401
from cp_compile.compiler.expand import expand_cp_ops
from cp_compile.compiler.order import overlap_edges, pin_overlap_order, schedule_listing


@pytest.fixture
def fake_group(request):
    world_size = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    yield world_size, dist.group.WORLD.group_name
    dist.destroy_process_group()


def expected_forward(c):
    """The designed order: step i+1's K/V go out before step i computes; waits after it."""
    listing = ["agree"] if c > 1 else []
    for i in range(c):
        listing += (["shift"] if i < c - 1 else []) + [f"attend step={i}"] + (["merge"] if i else [])
        listing += ["wait"] * 4 if i < c - 1 else []  # sent K, V, then received K, V
    return listing


def expected_backward(c, halves=True):
    """With ``halves``, steps after the first run in two head halves: the first while
    the dK/dV hop finishes, the second while the next K/V block travels."""
    listing = []
    for i in range(c):
        next_kv = ["shift"] if i < c - 1 else []
        step = [f"attend_backward step={i}"]
        dkv_arrives = ["wait"] * 4 if i else []  # dK/dV accumulated so far (and ours left)
        if i == 0 or not halves:
            listing += next_kv + step + dkv_arrives
        else:
            listing += step + dkv_arrives + next_kv + step
        listing += ["shift"] if c > 1 else []  # ... and leaves with this step's share
        listing += ["wait"] * 4 if i < c - 1 else []  # next K/V
    return listing + (["wait"] * 4 if c > 1 else [])  # own dK/dV home


def traced(fn, *shapes):
    with FakeTensorMode():
        args = [torch.empty(s, dtype=torch.float32) for s in shapes]
        return make_fx(fn, tracing_mode="fake")(*args)


@pytest.mark.parametrize("fake_group", [1, 2, 3, 4], indirect=True)
def test_forward_expands_to_overlapped_ring(fake_group):
    c, name = fake_group
    gm = traced(
        lambda q, k, v: torch.ops.cp.ring_attention(q, k, v, [], name, True, "zigzag", 0.25, True, "sdpa", "")[0],
        (1, 4, 8, 16),
        (1, 2, 8, 16),
        (1, 2, 8, 16),
    )
    (expansion,) = expand_cp_ops(gm.graph)
    gm.recompile()
    assert expansion.count(torch.ops.cp.ring_shift.default) == c - 1
    assert schedule_listing(gm.graph) == expected_forward(c)
    edges = pin_overlap_order(gm.graph)
    # per shift: compute after it; its four waits (2 sent, 2 received) after that;
    # a later shift also stays after the waits on what the previous one sent
    assert edges == 5 * (c - 1) + 2 * max(c - 2, 0)
    assert schedule_listing(gm.graph) == expected_forward(c)  # pinned, order unchanged
    gm.graph.lint()


@pytest.mark.parametrize("fake_group", [1, 2, 3, 4], indirect=True)
def test_backward_expands_with_travelling_dkv(fake_group):
    c, name = fake_group

    def backward(do, q, k, v, out, lse):
        return torch.ops.cp.ring_attention_backward(
            do, q, k, v, out, lse, None, [], name, True, "zigzag", 0.25, "sdpa", ""
        )

    shapes = [(1, 4, 8, 16), (1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), (1, 4, 8, 16), (1, 4, 8)]
    gm = traced(backward, *shapes)
    (expansion,) = expand_cp_ops(gm.graph)
    assert expansion.direction == "backward"
    assert expansion.count(torch.ops.cp.ring_shift.default) == (2 * c - 1 if c > 1 else 0)
    assert schedule_listing(gm.graph) == expected_backward(c)
    deps = overlap_edges(gm.graph)
    computes = [n for n in deps if n.target == torch.ops.cp.attend_backward.default]
    # every compute hides a transfer but the very last half step
    assert len(computes) == (2 * c - 2 if c > 1 else 0)
    # K/V shifts (C-1) and all dK/dV hops but the last (C-1): each pins 5 edges;
    # a K/V shift of a middle step also stays after the 4 dK/dV waits before it
    assert pin_overlap_order(gm.graph) == 10 * (c - 1) + 4 * max(c - 2, 0)
    assert schedule_listing(gm.graph) == expected_backward(c)


@pytest.mark.parametrize("fake_group", [2], indirect=True)
def test_expanded_graph_holds_no_rank(fake_group):
    _, name = fake_group
    gm = traced(
        lambda q, k, v: torch.ops.cp.ring_attention(q, k, v, [], name, True, "zigzag", 0.25, False, "sdpa", "")[0],
        (1, 2, 8, 16),
        (1, 2, 8, 16),
        (1, 2, 8, 16),
    )
    expand_cp_ops(gm.graph)
    gm.recompile()
    # constants in the code: the group name, steps, shift, tags, options; no peer rank
    for node in gm.graph.nodes:
        if node.target == torch.ops.cp.ring_shift.default:
            assert node.args[1:] in ((name, 1, 0),)
