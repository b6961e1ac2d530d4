"""Load balancers: shard / unshard / positions."""

import pytest
import torch

from cp_compile import layout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_shards_reassemble(world_size, kind):
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    shards = [layout.layout_named(kind).shard(x, 2, r, world_size) for r in range(world_size)]
    assert torch.equal(layout.layout_named(kind).unshard(shards, 2), x)
    every_position = torch.cat([layout.layout_named(kind).positions(24, r, world_size) for r in range(world_size)])
    assert sorted(every_position.tolist()) == list(range(24))


def test_zigzag_holds_chunks_r_and_mirror():
    # 8 tokens, C=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert layout.Zigzag().positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert layout.Zigzag().positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_indivisible_length_names_length_and_c():
    with pytest.raises(ValueError, match=r"sequence length 10 .* C=3"):
        layout.Zigzag().shard(torch.zeros(10), 0, 0, 3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_packed_and_balanced_layouts_answer_the_same_interface(world_size):
    """Packed documents and a BlockMask's balance shard, unshard and place tokens as the chunked layouts do."""
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_compile.layout.balanced import balance_blocks
    from cp_compile.layout.packed import Packed, packed_slots

    x = torch.arange(3 * 24).view(3, 24)
    cu = [0, 5, 12, 24]
    packed = Packed(cu)
    shards = [packed.shard(x, 1, r, world_size) for r in range(world_size)]
    assert torch.equal(packed.unshard(shards, 1), x)
    assert all(
        torch.equal(packed.positions(24, r, world_size), packed_slots(cu, r, world_size)["pos"])
        for r in range(world_size)
    )

    seq = 8 * 2 * world_size
    causal = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, seq, seq, device="cpu", BLOCK_SIZE=8)
    balanced = balance_blocks(causal, world_size)
    y = torch.arange(2 * seq).view(2, seq)
    shards = [balanced.shard(y, 1, r, world_size) for r in range(world_size)]
    assert torch.equal(balanced.unshard(shards, 1), y)
    every = torch.cat([balanced.positions(seq, r, world_size) for r in range(world_size)])
    assert torch.equal(every, balanced.all_positions(seq, world_size)) and sorted(every.tolist()) == list(range(seq))
    assert balanced.chunk(seq, world_size) == 8
    with pytest.raises(ValueError, match="balances a"):
        balanced.positions(seq + 8, 0, world_size)


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
