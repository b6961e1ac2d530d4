"""The GPU tier (``pytest -m cuda``): kernels, the Triton merge and whole schedules on one device.

Every check is written once over a ``device`` parameter. Its ``cuda`` cases carry
the ``cuda`` mark and skip, saying why, where no CUDA device is visible; its
``cpu`` cases run in the ordinary suite wherever the path exists on CPU, so CPU
CI runs everything but the device itself. Schedules run at C=2 (memory at C=2
and 4) as processes sharing the one GPU, gloo carrying the transfers (NCCL
refuses two ranks on one device; ``ops.comm`` stages device tensors through
host memory for gloo).

Error rule (DESIGN.md): against an fp64 reference, a CP result's error is at
most twice that of single-device SDPA in the same dtype on the same device.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, max_err, within_error_rule

NO_CUDA = "no CUDA device visible; the GPU tier runs with `pytest -m cuda` on a GPU machine"
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)])
DEVICES = ["cpu", CUDA]
LOW = ["float16", "bfloat16", "float32"]


def _errors_within_rule(ours, single, reference, names):
    within_error_rule(
        (name, max_err(got, want), max_err(same, want)) for name, got, same, want in zip(names, ours, single, reference)
    )


def _visible(lq: int, lk: int, mask: str) -> torch.Tensor:
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    if mask == "none":
        return torch.ones(lq, lk, dtype=torch.bool)
    return j <= i + (lk - lq if mask == "causal_bottom_right" else 0)


def _sdpa_grads(q, k, v, do, visible):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(q.device), enable_gqa=q.shape[1] != k.shape[1])
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------
# Block ops: one tile, every mask, through the kernel each device dispatches to.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_attn_on_device(device, dtype, mask, heads, head_dim):
    import cp_compile  # noqa: F401  (registers torch.ops.cp)

    (hq, hkv), lq = heads, 48
    lk = 80 if mask == "causal_bottom_right" else lq
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, hq, lq, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, hkv, lk, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    visible = _visible(lq, lk, mask)
    reference = _sdpa_grads(q, k, v, do, visible)
    low = [t.to(device, DTYPES[dtype]) for t in (q, k, v, do)]
    single = _sdpa_grads(*low, visible)
    leaves = [t.clone().requires_grad_() for t in low[:3]]
    out, lse = torch.ops.cp.block_attn(*leaves, mask, head_dim**-0.5)
    out.backward(low[3])
    assert lse.dtype == torch.float32 and lse.device == out.device
    ours = [out.detach()] + [t.grad for t in leaves]
    assert all(t.dtype == DTYPES[dtype] for t in ours)
    _errors_within_rule(ours, single, reference, ["out", "dq", "dk", "dv"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (7, 0), (5, 3)])
def test_packed_tiles_on_device(device, dtype, window):
    """The packed tile kernel on every rank's slots in sequence order: causal, full and window tiles."""
    from cp_compile.kernels import tiles
    from cp_compile.layout import packed

    lengths = [37, 5, 64, 1, 22]
    g = torch.Generator().manual_seed(7)
    total = sum(lengths)
    q, do = (torch.randn(total, 4, 64, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)

    def per_document(q, k, v, do):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        outs = []
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            behind = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]
            keep = (behind <= window[0]) | (window[0] < 0)
            keep &= (-behind <= window[1]) | (window[1] < 0)
            doc = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            outs.append(
                F.scaled_dot_product_attention(*doc, attn_mask=keep.to(q.device), enable_gqa=True)[0].transpose(0, 1)
            )
        out = torch.cat(outs)
        out.backward(do)
        return out.detach(), q.grad, k.grad, v.grad

    reference = per_document(q, k, v, do)
    low = [t.to(device, DTYPES[dtype]) for t in (q, k, v, do)]
    single = per_document(*low)
    runs = packed.sequence_segments(cu)
    plan = tiles.plan_tiles(runs, runs, *window)
    out, lse = tiles.tiles_attn(*low[:3], plan, 64**-0.5)
    grads = tiles.tiles_attn_backward(low[3], *low[:3], out, lse, None, plan, 64**-0.5)
    _errors_within_rule([out, *grads], single, reference, ["out", "dq", "dk", "dv"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("window", [None, 40])
def test_cached_attention_kernel_on_device(device, dtype, window):
    """The decode kernel (queries at positions against cache slots in any order, empty slots included)."""
    from cp_compile.kernels.masked import EMPTY_POSITION, positions_attn

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 3, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 300, 64, generator=g, dtype=torch.float64) for _ in range(2))
    k_pos = torch.randperm(300, generator=g)
    k_pos[k_pos > 280] = EMPTY_POSITION  # 19 empty slots
    q_pos = torch.tensor([250, 251, 252])
    behind = q_pos[:, None] - k_pos[None, :]
    visible = (behind >= 0) & ((behind < window) if window else True)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(q.device), enable_gqa=True)

    reference = sdpa(q, k, v)
    low = [t.to(device, DTYPES[dtype]) for t in (q, k, v)]
    out, _ = positions_attn(*low, q_pos.to(device), k_pos.to(device), -1 if window is None else window - 1, 64**-0.5)
    _errors_within_rule([out.to(low[0].dtype)], [sdpa(*low)], [reference], ["out"])


# ----------------------------------------------------------------------------
# The Triton merge on the device against the torch merge.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_start", [0, 5])
def test_merge_op_matches_torch_merge(device, row_start):
    from cp_compile.kernels.triton_merge import _merge_torch_, triton_available

    if device == "cuda" and not triton_available():
        pytest.skip("triton is not installed on this GPU machine (pip install -e '.[triton]')")
    g = torch.Generator().manual_seed(row_start)
    b, h, s, d = 2, 3, 40, 64
    acc_out = torch.randn(b, h, s, d, generator=g)
    acc_lse = torch.randn(b, h, s, generator=g)
    out = torch.randn(b, h, s - row_start, d, generator=g).to(torch.bfloat16)
    lse = torch.randn(b, h, s - row_start, generator=g)
    acc_lse[:, :, :3] = float("-inf")  # rows no step has reached yet
    lse[:, :, -2:] = float("-inf")  # rows this partial does not touch
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    _merge_torch_(want_out, want_lse, out, lse, row_start)
    got_out, got_lse = (t.to(device) for t in (acc_out, acc_lse))
    torch.ops.cp.merge_(got_out, got_lse, out.to(device), lse.to(device), row_start)
    assert not torch.isnan(got_out).any()
    torch.testing.assert_close(got_out.cpu(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)  # -inf rows stay -inf


# ----------------------------------------------------------------------------
# Whole schedules, eager and compiled, at C=2 on one device.
# ----------------------------------------------------------------------------


def _shard_errors(plan, out, leaves, single, reference) -> dict:
    """This rank's CP out and input gradients, and single-device same-dtype results, against fp64 (sharded alike)."""
    ours = [out.detach()] + [t.grad for t in leaves]
    return {
        "devices": sorted({str(t.device.type) for t in ours}),
        "cp_err": [max_err(o.cpu(), plan.shard(r, 2)) for o, r in zip(ours, reference)],
        "single_err": [max_err(plan.shard(s.cpu(), 2), plan.shard(r, 2)) for s, r in zip(single, reference)],
    }


def schedule_on_device(device: str, schedule: str, compiled: bool, dtype_name: str = "bfloat16"):
    from helpers import make_qkv, sdpa_with_grads

    import cp_compile

    plan = cp_compile.ContextParallel(schedule=schedule)
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_qkv(1, 4, 2, 64 * plan.world_size, 64, seed=3)
    reference = sdpa_with_grads(q, k, v, do, is_causal=True)
    single = sdpa_with_grads(*(t.to(device, dtype) for t in (q, k, v, do)), is_causal=True)
    leaves = [plan.shard(t, 2).to(device, dtype).requires_grad_() for t in (q, k, v)]

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fn = (
        torch.compile(attention, backend=plan.backend(), fullgraph=True)
        if compiled
        else (lambda q, k, v: plan.attention(q, k, v, is_causal=True, enable_gqa=True))
    )
    with cp_compile.count_traffic() as traffic:
        out = fn(*leaves)
        out.backward(plan.shard(do, 2).to(device, dtype))
    return {**_shard_errors(plan, out, leaves, single, reference), "shifts": traffic.shifts}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("device", DEVICES)
def test_schedules_on_device(ranks, device, schedule, compiled):
    if device == "cpu" and compiled:
        pytest.skip("compiled schedules on CPU are covered by test_compile, test_allgather and test_ulysses")
    for rank, result in enumerate(ranks(2, schedule_on_device, device, schedule, compiled, timeout=600)):
        assert result["devices"] == [device]
        names = [f"rank {rank} {schedule} {name}" for name in ("out", "dq", "dk", "dv")]
        within_error_rule(zip(names, result["cp_err"], result["single_err"]))
        assert result["shifts"] == (4 if schedule == "ring" else 0)  # ring: 1 K/V fwd, 1 K/V + 2 dK/dV bwd


def flex_on_device(device: str, schedule: str, dtype_name: str = "bfloat16"):
    """The flex tile path (mask evaluated densely per tile) on the device: a causal mask_mod."""
    from helpers import make_qkv, sdpa_with_grads
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    plan = cp_compile.ContextParallel()
    dtype, chunk = DTYPES[dtype_name], 32
    seq = 2 * plan.world_size * chunk
    q, k, v, do = make_qkv(1, 4, 2, seq, 64, seed=5)
    reference = sdpa_with_grads(q, k, v, do, is_causal=True)
    single = sdpa_with_grads(*(t.to(device, dtype) for t in (q, k, v, do)), is_causal=True)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = plan.shard(create_block_mask(causal, None, None, seq, seq, device=device, BLOCK_SIZE=chunk))
    leaves = [plan.shard(t, 2).to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = cp_compile.flex_attention(*leaves, block_mask=block_mask, enable_gqa=True, schedule=schedule)
    out.backward(plan.shard(do, 2).to(device, dtype))
    return _shard_errors(plan, out, leaves, single, reference)


@pytest.mark.parametrize("schedule", ["ring", "allgather"])
@pytest.mark.parametrize("device", DEVICES)
def test_flex_tiles_on_device(ranks, device, schedule):
    for rank, result in enumerate(ranks(2, flex_on_device, device, schedule, timeout=600)):
        assert result["devices"] == [device]
        names = [f"rank {rank} flex {schedule} {name}" for name in ("out", "dq", "dk", "dv")]
        within_error_rule(zip(names, result["cp_err"], result["single_err"]))


# ----------------------------------------------------------------------------
# Peak device memory of the ring at a fixed local shard: flat in C.
# ----------------------------------------------------------------------------


def ring_device_peak(s_local: int):
    import cp_compile
    from cp_compile.tools.memory import PeakMemory

    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, s_local, 128, generator=g).to(device, torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    cp_compile.ring_attention(*leaves, is_causal=True).backward(do)  # warm-up
    for t in leaves:
        t.grad = None
    with PeakMemory(device) as mem:
        cp_compile.ring_attention(*leaves, is_causal=True).backward(do)
    return mem.peak_bytes / (q.numel() * q.element_size())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_ring_device_memory_flat_in_c(ranks):
    peaks = {c: max(ranks(c, ring_device_peak, 4096, timeout=600)) for c in (2, 4)}
    # the CPU suite's bound (test_memory): C=4 within 10% and one unit of C=2
    assert peaks[4] <= 1.1 * peaks[2] + 1.0, peaks
