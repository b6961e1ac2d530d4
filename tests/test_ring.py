"""Eager ring attention on real gloo ranks against single-device SDPA."""

import pytest
import torch
from helpers import DTYPES, make_qkv, max_err, sdpa_with_grads

# (B, Hq, Hkv, S per rank, D, causal, layout): GQA, odd heads, head dims that are
# not powers of two, B > 1, both layouts.
CONFIGS = {
    "causal-zigzag-gqa": (2, 4, 2, 8, 16, True, "zigzag"),
    "noncausal-odd-heads": (1, 3, 3, 6, 10, False, "zigzag"),
    "causal-contiguous": (2, 2, 1, 4, 8, True, "contiguous"),
    "causal-d24-5heads": (1, 5, 5, 12, 24, True, "zigzag"),
    "noncausal-contiguous-gqa": (1, 6, 2, 5, 12, False, "contiguous"),
}


def run_ring(b, hq, hkv, s_local, d, causal, layout, dtype_name="float64", seed=0):
    """On every rank: CP forward/backward vs the single-device result, sharded alike."""
    import cp_compile

    dtype = DTYPES[dtype_name]
    plan = cp_compile.ContextParallel(load_balance=layout)
    q, k, v, do = make_qkv(b, hq, hkv, s_local * plan.world_size, d, dtype=torch.float64, seed=seed)
    low = [t.to(dtype) for t in (q, k, v, do)]
    reference = sdpa_with_grads(q, k, v, do, is_causal=causal)  # fp64 truth
    single = sdpa_with_grads(*low, is_causal=causal)  # one device, same dtype
    leaves = [plan.shard(t, 2).requires_grad_() for t in low[:3]]
    with cp_compile.count_traffic() as fwd:
        out = cp_compile.ring_attention(*leaves, is_causal=causal, enable_gqa=hq != hkv, layout=layout)
    with cp_compile.count_traffic() as bwd:
        out.backward(plan.shard(low[3], 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return {
        "cp_err": [max_err(g, plan.shard(r, 2)) for g, r in zip(got, reference)],
        "single_err": [max_err(plan.shard(s, 2), plan.shard(r, 2)) for s, r in zip(single, reference)],
        "nan": any(torch.isnan(g).any().item() for g in got),
        "dtypes": [str(g.dtype) for g in got],
        "fwd": (fwd.by_tag, fwd.bytes_sent),
        "bwd": (bwd.by_tag, bwd.bytes_sent),
        "kv_bytes": leaves[1].numel() * leaves[1].element_size() * 2,
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp64_equals_single_device(ranks, world_size, config):
    for result in ranks(world_size, run_ring, *CONFIGS[config]):
        assert not result["nan"]
        assert max(result["cp_err"]) < 1e-10, result["cp_err"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
def test_low_precision_within_twice_single_device_error(ranks, world_size, dtype, causal):
    s_local = 192 // world_size
    for result in ranks(world_size, run_ring, 1, 4, 2, s_local, 32, causal, "zigzag", dtype, seed=1):
        assert result["dtypes"] == [f"torch.{dtype}"] * 4
        for name, cp, single in zip(("out", "dq", "dk", "dv"), result["cp_err"], result["single_err"]):
            assert cp <= 2 * single, f"{name}: CP error {cp:.3g} vs single-device {single:.3g}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_transfers_are_exactly_the_designed_ones(ranks, world_size):
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for result in ranks(world_size, run_ring, 1, 2, 2, 6, 8, True, "zigzag"):
        kv = result["kv_bytes"]  # k + v of one rank, fp64 (also the dK/dV accumulator dtype)
        assert result["fwd"] == ({TAG_KV: world_size - 1}, (world_size - 1) * kv)
        # backward: K/V again C-1 times, the travelling dK/dV C times (its last hop brings it home)
        assert result["bwd"] == ({TAG_KV: world_size - 1, TAG_DKV: world_size}, (2 * world_size - 1) * kv)


def test_single_rank_sends_nothing(ranks):
    (result,) = ranks(1, run_ring, 1, 2, 2, 8, 8, True, "zigzag")
    assert result["fwd"] == ({}, 0) and result["bwd"] == ({}, 0)


def opcheck_comm_ops():
    import torch.distributed as dist

    import cp_compile  # noqa: F401

    name = dist.group.WORLD.group_name
    q, k, v, do = make_qkv(1, 2, 1, 8, 6)
    out, lse = torch.ops.cp.ring_attention(q, k, v, [], name, True, "zigzag", 0.4, True, "sdpa", "")
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]
    step = ("sdpa", 1, name, 1, True, "zigzag", 0.4, "")
    cases = [
        (torch.ops.cp.ring_attention.default, (*req(q, k, v), [], name, True, "zigzag", 0.4, True, "sdpa", "")),
        (
            torch.ops.cp.ring_attention_backward.default,
            (do, q, k, v, out, lse, None, [], name, True, "zigzag", 0.4, "sdpa", ""),
        ),
        (torch.ops.cp.attend.default, (q, k, v, [], *step)),
        (torch.ops.cp.attend_backward.default, (do, q, k, v, out, lse, None, [], *step)),
        (torch.ops.cp.agree.default, (q, k, v, name, "x")),
        (torch.ops.cp.send_buffers.default, ([k.transpose(2, 3), v],)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    # A shift's buffers are only defined after the wait, so compare waited results.
    sent = [torch.full((3,), float(dist.get_rank()))]
    test_utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.cp.ring_shift.default, (sent, name, 1, 0), test_utils=test_utils)
    received = torch.ops.cp.ring_shift(sent, name, 1, 0)
    return [torch.ops._c10d_functional.wait_tensor(t).tolist() for t in received]


def test_opcheck_comm_ops(ranks):
    assert ranks(2, opcheck_comm_ops) == [[[1.0] * 3], [[0.0] * 3]]


def ring_hops_as_groups():
    """Every ring_shift of an eager fwd+bwd, as the batches handed to ``dist.batch_isend_irecv``."""
    import torch.distributed as dist

    import cp_compile

    plan = cp_compile.ContextParallel()
    rank, size = plan.rank, plan.world_size
    q, k, v, do = (plan.shard(t, 2) for t in make_qkv(1, 4, 2, 8 * size, 8))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    batches = []
    original = dist.batch_isend_irecv

    def recorded(p2p_ops):
        batches.append([("send" if op.op is dist.isend else "recv", op.peer) for op in p2p_ops])
        return original(p2p_ops)

    dist.batch_isend_irecv = recorded
    try:
        with cp_compile.count_traffic() as traffic:
            cp_compile.ring_attention(*leaves, is_causal=True, enable_gqa=True).backward(do)
    finally:
        dist.batch_isend_irecv = original
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    # each hop moves two tensors (K and V, or dK and dV): send both to the next rank, receive both from the previous
    expected_hop = [("send", nxt), ("recv", prev)] * 2
    return traffic.shifts, batches, expected_hop


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_hop_is_one_grouped_operation(ranks, world_size):
    for shifts, batches, expected_hop in ranks(world_size, ring_hops_as_groups):
        # forward C-1 K/V hops; backward C-1 K/V hops and C dK/dV hops
        assert shifts == len(batches) == 3 * world_size - 2
        assert all(batch == expected_hop for batch in batches), batches
