"""Load balancers: shard / unshard / positions."""

import pytest
import torch

from cp_compile import layout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_shards_reassemble(world_size, kind):
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    shards = [layout.shard(x, 2, r, world_size, kind) for r in range(world_size)]
    assert torch.equal(layout.unshard(shards, 2, kind), x)
    every_position = torch.cat([layout.positions(24, r, world_size, kind) for r in range(world_size)])
    assert sorted(every_position.tolist()) == list(range(24))


def test_zigzag_holds_chunks_r_and_mirror():
    # 8 tokens, C=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert layout.positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]


def test_indivisible_length_names_length_and_c():
    with pytest.raises(ValueError, match=r"sequence length 10 .* C=3"):
        layout.shard(torch.zeros(10), 0, 0, 3, "zigzag")


def plan_roundtrip(seq_dim):
    import cp_compile

    plan = cp_compile.ContextParallel()
    x = torch.arange(4 * 2 * plan.world_size * 3, dtype=torch.float32).view(4, -1, 3)
    local = plan.shard(x, seq_dim)
    return torch.equal(plan.unshard(local, seq_dim), x), plan.positions(x.shape[1]).tolist(), repr(plan)


def test_plan_shard_unshard_on_ranks(ranks):
    results = ranks(3, plan_roundtrip, 1)
    assert all(ok for ok, _, _ in results)
    assert [p for _, p, _ in results] == [[0, 5], [1, 4], [2, 3]]
    assert "C=3, rank=1" in results[1][2]
