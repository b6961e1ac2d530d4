"""Ulysses (all-to-all) attention on real gloo ranks against single-device SDPA."""

import pytest
import torch

from helpers import DTYPES, make_qkv, max_err, sdpa_with_grads

# (B, Hq, Hkv, S per rank, D, causal, layout). 12 query heads split over C = 1..4;
# 4 and 6 K/V heads need replication at C = 3 and C = 4 respectively.
CONFIGS = {
    "causal-zigzag": (1, 12, 12, 6, 8, True, "zigzag"),
    "noncausal-gqa4": (2, 12, 4, 4, 6, False, "zigzag"),
    "causal-gqa6-contiguous": (1, 12, 6, 5, 8, True, "contiguous"),
    "causal-gqa4-zigzag": (1, 12, 4, 4, 10, True, "zigzag"),
}


def run_ulysses(b, hq, hkv, s_local, d, causal, layout, dtype_name="float64", seed=0, lse_grad=False):
    import cp_compile
    from cp_compile.ops.ulysses import ulysses_attention_op

    dtype = DTYPES[dtype_name]
    plan = cp_compile.ContextParallel(load_balance=layout)
    q, k, v, do = make_qkv(b, hq, hkv, s_local * plan.world_size, d, dtype=torch.float64, seed=seed)
    low = [t.to(dtype) for t in (q, k, v, do)]
    reference = sdpa_with_grads(q, k, v, do, is_causal=causal)
    single = sdpa_with_grads(*low, is_causal=causal)
    leaves = [plan.shard(t, 2).requires_grad_() for t in low[:3]]
    out = cp_compile.ulysses_attention(*leaves, is_causal=causal, enable_gqa=hq != hkv, layout=layout)
    out.backward(plan.shard(low[3], 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return {
        "cp_err": [max_err(g, plan.shard(r, 2)) for g, r in zip(got, reference)],
        "single_err": [max_err(plan.shard(s, 2), plan.shard(r, 2)) for s, r in zip(single, reference)],
        "dtypes": [str(g.dtype) for g in got],
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp64_equals_single_device(ranks, world_size, config):
    for result in ranks(world_size, run_ulysses, *CONFIGS[config]):
        assert max(result["cp_err"]) < 1e-10, result["cp_err"]
