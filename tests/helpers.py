"""Reference data and error measures shared by tests (imported inside rank workers too)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# (what, CP error, single-device error) of each check of the error rule in the running test, in order: the GPU
# check (python -m cp_compile gpu-check) reports them with the test's outcome (tests/conftest.py)
MEASURED_ERRORS: list[tuple[str, float, float]] = []


def within_error_rule(checks) -> None:
    """The error rule (DESIGN.md) for each (what, CP error, single-device error) of ``checks``: against fp64, a
    CP result's error is at most twice single-device SDPA's in the same dtype. Every check is recorded before
    the first that fails raises."""
    checks = list(checks)
    MEASURED_ERRORS.extend(checks)
    broken = [
        f"{what}: CP error {err:.3g}, single-device {single:.3g}" for what, err, single in checks if err > 2 * single
    ]
    assert not broken, f"over twice single-device SDPA's error against fp64: {'; '.join(broken)}"


def varlen_gqa() -> dict:
    """The keyword that tells torch's ``varlen_attn`` its key/value heads are fewer: ``enable_gqa`` since torch 2.13;
    2.11's takes none (its op is traced only here, and the CP rewrite reads GQA off the head counts)."""
    from cp_compile.torch_compat import varlen_takes_gqa

    return {"enable_gqa": True} if varlen_takes_gqa() else {}


def make_qkv(b, hq, hkv, s, d, dtype=torch.float64, seed=0, dv=None):
    """Seeded global q, k, v and an output gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64)
    do = torch.randn(b, hq, s, dv, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def sdpa_with_grads(q, k, v, do, **kwargs):
    """Single-device SDPA output and input gradients (in the inputs' dtype)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def max_err(a, b) -> float:
    """Largest absolute difference; a device's result against a reference computed on the CPU, too."""
    diff = (a.double().cpu() - b.double().cpu()).abs()
    return diff.max().item() if diff.numel() else 0.0


@contextlib.contextmanager
def count_all_to_alls():
    """The shapes of the all-to-alls the head-sharding exchange (``ops.heads``) issues in this
    process inside the block, in order. Eager runs only: a compiled graph traces the exchange once
    (count the expanded graph's ``all_to_all_single`` nodes there)."""
    from cp_compile.comm import exchange as heads

    calls: list[tuple] = []
    original = heads._exchange

    def counted(x, group_name, world_size):
        calls.append(tuple(x.shape))
        return original(x, group_name, world_size)

    heads._exchange = counted
    try:
        yield calls
    finally:
        heads._exchange = original
