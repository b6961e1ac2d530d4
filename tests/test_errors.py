"""Bad input raises the same clear error on every rank, fast, instead of hanging."""

import pytest
import torch
from helpers import make_qkv

FAST = 30.0  # seconds; the gloo timeout is 60 s, so a hang fails the test instead of passing late


def attention_with_local(mutate: str):
    """Run ring attention where rank 1 deviates as ``mutate`` says; return the error."""
    import torch.distributed as dist

    import cp_compile

    rank = dist.get_rank()
    s_local, causal, heads = 32, True, 2
    if rank == 1 and mutate == "length":
        s_local = 48
    if rank == 1 and mutate == "causal":
        causal = False
    if rank == 1 and mutate == "heads":
        heads = 4
    q, k, v, _ = make_qkv(1, heads, 2, s_local, 8)
    if rank == 1 and mutate == "ndim":
        q = q[0]
    try:
        cp_compile.ring_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("mutate", ["length", "causal", "heads", "ndim"])
def test_rank_mismatch_raises_same_error_everywhere(ranks, mutate):
    results = ranks(2, attention_with_local, mutate, timeout=FAST)
    assert results[0] is not None and results[0] == results[1]
    kind, message = results[0]
    assert kind == "ValueError" and "ranks disagree" in message
    if mutate == "length":
        assert "(1, 2, 32, 8)" in message and "(1, 2, 48, 8)" in message


def compiled_later_site_differs():
    """A compiled graph of two attention sites where only the second differs between ranks (its head count):
    the graph keeps one agreement, whose digest of both sites' sizes differs."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import cp_compile

    plan = cp_compile.ContextParallel()
    heads = 4 if dist.get_rank() == 0 else 2
    q, k, v, _ = make_qkv(1, 4, 4, 16, 8)

    def two(q, k, v):
        first = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(first[:, :heads], k[:, :heads], v[:, :heads], is_causal=True)

    compiled = torch.compile(two, backend=plan.backend("aot_eager"), fullgraph=True)
    try:
        with plan:
            compiled(*(plan.shard(t, 2) for t in (q, k, v)))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def test_a_compiled_later_site_that_differs_raises_everywhere(ranks):
    results = ranks(2, compiled_later_site_differs, timeout=120)
    assert results[0] is not None and results[1] is not None, results
    assert all("ranks disagree" in message for _, message in results), results


def local_error(case: str):
    import cp_compile

    plan = cp_compile.ContextParallel()
    q, k, v, _ = make_qkv(1, 4, 2, 8, 8)
    calls = {
        "dropout": lambda: cp_compile.ring_attention(q, k, v, dropout_p=0.1, enable_gqa=True),
        "gqa": lambda: cp_compile.ring_attention(q, k, v),
        "layout": lambda: cp_compile.ring_attention(q, q, q, layout="spiral"),
        "shard": lambda: plan.shard(torch.zeros(1, 2, 30, 4), seq_dim=2),
        "odd-local": lambda: cp_compile.ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], is_causal=True),
    }
    try:
        calls[case]()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "case,kind,words",
    [
        ("dropout", "NotImplementedError", "dropout_p=0.1"),
        ("gqa", "ValueError", "enable_gqa=True"),
        ("layout", "ValueError", "spiral"),
        ("shard", "ValueError", "sequence length 30"),
        ("odd-local", "ValueError", "holds 2 equal chunks per rank"),
    ],
)
def test_unsupported_input_is_named(ranks, case, kind, words):
    results = ranks(2, local_error, case, timeout=FAST)
    assert results[0] == results[1]
    assert results[0][0] == kind and words in results[0][1], results[0]
    if case == "shard":
        assert "C=2" in results[0][1]


def test_pool_survives_errors(ranks):
    """After the errors above, the same ranks still run collectives."""
    assert ranks(2, attention_with_local, "none", timeout=FAST) == [None, None]
