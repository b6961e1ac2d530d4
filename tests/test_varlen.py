"""Packed documents (THD, cu_seqlens) under CP: layout, eager schedules, the compiled varlen_attn rewrite."""

import pytest
import torch
import torch.nn.functional as F
from helpers import max_err, varlen_gqa

from cp_compile.layout import packed

# Lengths that do not divide by 2C, a length-1 document, documents shorter than
# 2C (some ranks hold only their padding), a zero-length document.
LENGTHS = [13, 1, 0, 3, 22, 5]
WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 1)]


def packed_inputs(lengths, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, do, cu


def window_mask(n, left, right):
    i = torch.arange(n)
    behind = i[:, None] - i[None, :]
    mask = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        mask &= behind <= left
    if right >= 0:
        mask &= -behind <= right
    return mask


def per_document_reference(q, k, v, do, cu, window):
    """Single-device attention of each document on its own, with input gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        tq, tk, tv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=window_mask(b - a, *window), enable_gqa=tq.shape[1] != tk.shape[1]
        )
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------
# Layout (no ranks needed).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_packed_layout_edge_cases(world_size):
    cu = torch.tensor([0, 13, 14, 14, 17, 39, 44], dtype=torch.int32)
    x = torch.arange(44 * 2).view(44, 2) + 1  # no zeros: padding is recognisable
    shards = [packed.shard_packed(x, 0, cu, r, world_size) for r in range(world_size)]
    assert len({s.shape[0] for s in shards}) == 1  # every rank holds as many slots
    assert shards[0].shape[0] == packed.packed_local_len(cu, world_size)
    assert torch.equal(packed.unshard_packed(shards, 0, cu), x)
    real = torch.cat([packed.packed_slots(cu, r, world_size)["real"] for r in range(world_size)])
    assert real.sum().item() == 44  # every real token exactly once
    for r, s in enumerate(shards):
        slots = packed.packed_slots(cu, r, world_size)
        assert (s[~slots["real"]] == 0).all()
        # positions inside each document: exact, not rounded by 2C
        real = slots["real"]
        assert torch.equal(s[real][:, 0] - 1, 2 * (cu[slots["doc"][real]].long() + slots["pos"][real]))


def test_per_document_zigzag_chunks():
    # a 5-token document over C=2: 4 chunks of 2 slots (3 pad slots at the tail);
    # rank 0 holds chunks 0 and 3 (positions 0,1 and 6,7: padding), rank 1 chunks 1 and 2
    cu = [0, 5, 6]  # then a length-1 document: only rank 0 holds its token
    zero, one = (packed.packed_slots(cu, r, 2) for r in (0, 1))
    assert zero["pos"].tolist() == [0, 1, 6, 7, 0, 3] and zero["real"].tolist() == [1, 1, 0, 0, 1, 0]
    assert one["pos"].tolist() == [2, 3, 4, 5, 1, 2] and one["real"].tolist() == [1, 1, 1, 0, 0, 0]
    assert zero["index"].tolist() == [0, 1, -1, -1, 5, -1]


def test_bad_cu_seqlens_named():
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed.shard_packed(torch.zeros(5), 0, [0, 3, 2], 0, 2)
    with pytest.raises(ValueError, match="cu_seqlens ends at 4"):
        packed.shard_packed(torch.zeros(5), 0, [0, 4], 0, 2)


# ----------------------------------------------------------------------------
# The tile kernel (one process): per-document tiles over runs of real tokens.
# ----------------------------------------------------------------------------


def _tiles_case(lengths, world_size, window, q_ranks, k_runs_of):
    from cp_compile.kernels import tiles

    q, k, v, do, cu = packed_inputs(lengths, 4, 2, 8)
    out, dq, dk, dv = per_document_reference(q, k, v, do, cu, window)
    slots = lambda t, ranks: torch.cat([packed.shard_packed(t, 0, cu, r, world_size) for r in ranks])  # noqa: E731
    q_runs = packed.packed_segments(cu, q_ranks, world_size)
    k_runs, k_all, v_all = k_runs_of(cu, k, v)
    plan = tiles.plan_tiles(q_runs, k_runs, *window)
    ql = slots(q, q_ranks)
    o, lse = tiles.tiles_attn(ql, k_all, v_all, plan, 8**-0.5)
    grads = tiles.tiles_attn_backward(slots(do, q_ranks), ql, k_all, v_all, o, lse, None, plan, 8**-0.5)
    assert max_err(o, slots(out, q_ranks)) < 1e-12
    assert max_err(grads[0], slots(dq, q_ranks)) < 1e-12
    return plan, grads, (dk, dv)


@pytest.mark.parametrize("window", WINDOWS + [(0, 0), (-1, 2), (2, -1)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_tiles_in_sequence_order_equal_per_document_attention(world_size, window):
    # the all-gather's form: every key in global packed order, one run per document
    def sequence(cu, k, v):
        return packed.sequence_segments(cu), k, v

    for rank in range(world_size):
        plan, (_, dk, dv), (ref_dk, ref_dv) = _tiles_case(LENGTHS, world_size, window, [rank], sequence)
        if window[0] < 0:  # unbounded behind: fused kernels only
            assert {t.mask for t in plan} <= {"none", "causal"}
        for t in plan:  # math-path tiles stay within the window's reach
            if t.mask == "band" and window[1] >= 0:
                assert t.k_len <= t.q_len + window[0] + window[1]


@pytest.mark.parametrize("window", [(40, 0), (16, 3), (300, 0)])
def test_a_long_band_runs_in_blocks_of_queries(window):
    """A window over runs longer than ``BAND_ROWS``: the band is cut into blocks of queries, each against the keys its
    window reaches, so that no math-path tile is the run squared; exact against per-document attention."""
    from cp_compile.kernels.tiles import BAND_ROWS

    def sequence(cu, k, v):
        return packed.sequence_segments(cu), k, v

    plan, _, _ = _tiles_case([1300, 5, 700], 1, window, [0], sequence)
    bands = [t for t in plan if t.mask == "band"]
    assert bands and all(t.q_len <= BAND_ROWS and t.k_len <= t.q_len + sum(window) for t in bands), bands


@pytest.mark.parametrize("window", WINDOWS)
def test_tiles_over_rank_ordered_chunks(window):
    # the Ulysses form: every rank's slots in rank order, queries and keys alike
    c = 3
    ranks = list(range(c))

    def rank_order(cu, k, v):
        slots = lambda t: torch.cat([packed.shard_packed(t, 0, cu, r, c) for r in ranks])  # noqa: E731
        return packed.packed_segments(cu, ranks, c), slots(k), slots(v)

    plan, (_, dk, dv), (ref_dk, ref_dv) = _tiles_case(LENGTHS, c, window, ranks, rank_order)
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    slots = lambda t: torch.cat([packed.shard_packed(t, 0, cu, r, c) for r in ranks])  # noqa: E731
    assert max_err(dk, slots(ref_dk)) < 1e-12 and max_err(dv, slots(ref_dv)) < 1e-12
    if window[0] < 0:
        assert all(t.mask != "band" for t in plan)  # causal or full: no math-path tile


def test_runs_cover_exactly_the_real_slots():
    cu = [0, 13, 14, 14, 17, 39, 44]
    for c in (1, 2, 3, 4):
        for r in range(c):
            slots = packed.packed_slots(cu, r, c)
            covered = torch.zeros_like(slots["real"])
            for run in packed.packed_segments(cu, [r], c):
                rows = slice(run.row, run.row + run.length)
                assert (slots["doc"][rows] == run.doc).all()
                assert (slots["pos"][rows] == torch.arange(run.pos, run.pos + run.length)).all()
                covered[rows] = True
            assert (covered == slots["real"]).all()
        perm = packed.sequence_permutation(cu, c)
        index = torch.cat([packed.packed_slots(cu, r, c)["index"] for r in range(c)])[perm]
        assert (index[: cu[-1]] == torch.arange(cu[-1])).all() and (index[cu[-1] :] == -1).all()


# ----------------------------------------------------------------------------
# Eager schedules on gloo ranks.
# ----------------------------------------------------------------------------


def run_packed(lengths, hq, hkv, d):
    """Every schedule and window on this rank: fp64 errors against per-document attention."""
    import cp_compile
    from cp_compile.kinds import packed as varlen_ops

    plan = cp_compile.ContextParallel()
    q, k, v, do, cu = packed_inputs(lengths, hq, hkv, d)
    slots = packed.packed_slots(cu, plan.rank, plan.world_size)
    pad = ~slots["real"]
    results = []
    for schedule in ("allgather", "ring"):
        for window in WINDOWS:
            reference = per_document_reference(q, k, v, do, cu, window)
            leaves = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
            # gradients arriving at padding rows must not leak anywhere
            local_do = plan.shard(do, 0, cu_seqlens=cu) + pad[:, None, None] * torch.randn(len(pad), hq, d)
            computed = []
            real_attn = varlen_ops.tiles_attn  # counts the forward calls with any tile to compute
            varlen_ops.tiles_attn = lambda q, k, v, tiles, *rest: (
                computed.extend([1] if tiles else []) or real_attn(q, k, v, tiles, *rest)
            )
            try:
                out = cp_compile.varlen_attention(
                    *leaves, cu, window_size=window, enable_gqa=hq != hkv, schedule=schedule
                )
                n_forward = len(computed)
                out.backward(local_do)
            finally:
                varlen_ops.tiles_attn = real_attn
            got = [out.detach()] + [t.grad for t in leaves]
            results.append(
                {
                    "case": (schedule, window),
                    "errors": [max_err(g, plan.shard(r, 0, cu_seqlens=cu)) for g, r in zip(got, reference)],
                    "unshard_err": max_err(plan.unshard(out.detach(), 0, cu_seqlens=cu), reference[0]),
                    "nan": any(not torch.isfinite(g).all().item() for g in got),
                    "padding_zero": all((g[pad] == 0).all().item() for g in got[:2]),
                    "forward_blocks_computed": n_forward,
                }
            )
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_packed_fp64_equals_per_document_attention(ranks, world_size):
    for per_rank in ranks(world_size, run_packed, LENGTHS, 4, 2, 8, timeout=300):
        for result in per_rank:
            case = result["case"]
            assert not result["nan"], case
            assert result["padding_zero"], case  # padding rows: out = 0, dq = 0
            assert max(result["errors"]) < 1e-10, (case, result["errors"])
            assert result["unshard_err"] < 1e-10, case


def test_ring_skips_blocks_outside_every_window(ranks):
    # long documents, a window of 2: each query sees only its own and neighbouring chunks
    for per_rank in ranks(4, run_packed, [64, 40], 2, 2, 4, timeout=300):
        by_case = {r["case"]: r for r in per_rank}
        assert max(max(r["errors"]) for r in per_rank) < 1e-10
        assert by_case[("ring", (-1, -1))]["forward_blocks_computed"] == 4
        assert by_case[("ring", (2, 1))]["forward_blocks_computed"] < 4


def opcheck_packed_ops():
    import torch.distributed as dist

    from cp_compile.kinds.packed import PackedSettings

    name = dist.group.WORLD.group_name
    c = dist.get_world_size()
    q, k, v, do, cu = packed_inputs([5, 1, 0, 3], 4, 2, 6)
    q, k, v, do = (packed.shard_packed(t, 0, cu, dist.get_rank(), c) for t in (q, k, v, do))
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    cases = []
    settings = (name, False, "contiguous", 0.4)
    for schedule in ("allgather", "ring"):
        forward = getattr(torch.ops.cp, f"{schedule}_attention")
        backward = getattr(torch.ops.cp, f"{schedule}_attention_backward")
        out, lse = forward(q, k, v, [cu], *settings, True, "packed", PackedSettings(2, 0).encode())
        cases += [
            (forward.default, (*req(q, k, v), [cu], *settings, True, "packed", PackedSettings(2, 0).encode())),
            (
                backward.default,
                (do, q, k, v, out, lse, lse.clone(), [cu], *settings, "packed", PackedSettings(2, 0).encode()),
            ),
        ]
    k_all, v_all = (torch.cat([t] * c) for t in (k, v))
    step = lambda i, window: ("packed", i, name, 1, False, "contiguous", 0.4, PackedSettings(*window).encode())  # noqa: E731
    cases += [
        (torch.ops.cp.attend.default, (q, k_all, v_all, [cu], *step(-1, (-1, 0)))),
        (torch.ops.cp.attend.default, (q, k, v, [cu], *step(1, (-1, -1)))),
        (torch.ops.cp.attend_backward.default, (do, q, k, v, out, lse, None, [cu], *step(1, (2, 0)))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    return True


def test_opcheck_packed_ops(ranks):
    assert ranks(2, opcheck_packed_ops) == [True, True]


# ----------------------------------------------------------------------------
# torch's varlen_attn in a compiled model.
# ----------------------------------------------------------------------------


def compiled_varlen(inner: str):
    """Two varlen_attn sites (a short causal window with GQA; full causal), compiled for one device."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    import cp_compile
    from cp_compile.cost.masked import choose_packed

    # A profile (slow kernel launches, a fast link) under which the estimates pick the all-gather for
    # the windowed GQA site (one kernel instead of C, and its busiest ring steps carry more than its
    # busiest row) and the ring for the causal one (its transfers hide under compute), so both compiled
    # schedules run here. The default CPU profile picks the all-gather for both: at 44 tokens every
    # transfer is latency-bound.
    machine = cp_compile.Machine("cpu", flops=1e9, bandwidth=3e8, latency=1e-6, kernel_overhead=1e-5)
    plan = cp_compile.ContextParallel(machine=machine)
    lengths = [13, 1, 0, 3, 22, 5]
    q, k, v, do, cu = packed_inputs(lengths, 4, 1, 8)
    max_len = max(lengths)

    gqa = varlen_gqa()

    def model(q, k, v, cu):
        kk = k.repeat_interleave(4, 1)
        a, lse = varlen_attn(
            q, k, v, cu, cu, max_len, max_len, window_size=(2, 0), **gqa, return_aux=AuxRequest(lse=True)
        )
        b = varlen_attn(q, kk, v.repeat_interleave(4, 1), cu, cu, max_len, max_len, window_size=(-1, 0))
        return a * b, lse.detach()

    def reference_model(q, k, v):
        a = per_document_reference_out(q, k, v, cu, (2, 0))
        b = per_document_reference_out(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), cu, (-1, 0))
        return a * b

    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_model(*ref_inputs)
    ref_out.backward(do)
    torch._dynamo.reset()
    counters.clear()
    backend = plan.backend(inner)
    local = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    out, lse = torch.compile(model, backend=backend, fullgraph=True)(*local, cu)
    out.backward(plan.shard(do, 0, cu_seqlens=cu))
    errs = [max_err(out, plan.shard(ref_out.detach(), 0, cu_seqlens=cu))]
    # varlen_attn's lse is [H, T]; padding slots see nothing (-inf)
    real = packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
    ref_lse = plan.shard(per_document_lse(q, k, cu, (2, 0)), 0, cu_seqlens=cu)
    lse_ok = (
        lse.dtype == torch.float32
        and lse.shape == (4, len(real))  # fp32, as varlen_attn returns it
        and bool(torch.isneginf(lse.t()[~real]).all())
        and max_err(lse.t()[real], ref_lse[real]) < 1e-5
    )
    errs += [max_err(a.grad, plan.shard(b.grad, 0, cu_seqlens=cu)) for a, b in zip(local, ref_inputs)]
    decisions = [(s.pattern, s.decision.schedule, s.decision.why) for r in backend.records for s in r.sites]
    from cp_compile.compiler.explain import site_report

    reports = [str(site_report(s, plan.world_size)) for r in backend.records for s in r.sites]
    # eager varlen_attention(schedule="auto") decides with the same function; given the facts a compiled
    # site has (shapes and window; the documents are a run-time input), it decides the same
    eager = [
        choose_packed(local[0], kv, kv, None, plan.world_size, window, machine)[0]
        for kv, window in ((local[1].detach(), (2, 0)), (local[1].detach().repeat_interleave(4, 1), (-1, 0)))
    ]
    return errs, decisions, sum(counters["graph_break"].values()), reports, lse_ok, eager


def per_document_reference_out(q, k, v, cu, window):
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if a < b:
            tq, tk, tv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(
                tq, tk, tv, attn_mask=window_mask(b - a, *window), enable_gqa=tq.shape[1] != tk.shape[1]
            )
            outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def per_document_lse(q, k, cu, window):
    """[T, Hq] log-sum-exp of each token's visible scores (GQA: K repeated)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype)
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if a < b:
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / q.shape[-1] ** 0.5
            lse[a:b] = s.masked_fill(~window_mask(b - a, *window), float("-inf")).logsumexp(-1).t()
    return lse


# aot_eager keeps this test cheap; the same graphs also pass through Inductor
# (inner="inductor"), which the SDPA all-gather test exercises on every run.
@pytest.mark.parametrize("inner", ["aot_eager"])
def test_compiled_varlen_attn_rewrite(ranks, inner):
    results = ranks(3, compiled_varlen, inner, timeout=600)
    assert all(r[1] == results[0][1] for r in results)  # every rank: the same schedules, for the same reasons
    for errs, decisions, breaks, reports, lse_ok, eager in results:
        assert breaks == 0
        assert lse_ok
        assert "schedule: allgather over C=3 (auto:" in reports[0] and "window (2, 0); the documents are" in reports[0]
        assert "schedule: ring over C=3" in reports[1] and "causal" in reports[1]
        for report in reports:  # the cost model's table, as for SDPA sites
            assert "candidates (cpu (default)" in report and "ulysses   not possible: 4 query heads" in report
        assert "* allgather" in reports[0] and "* ring" in reports[1]
        assert [(pattern, schedule) for pattern, schedule, _ in decisions] == [
            ("varlen", "allgather"),
            ("varlen", "ring"),
        ]
        assert "run-time input" in decisions[0][2] and "one document of" in decisions[0][2]
        assert eager == ["allgather", "ring"]
        assert max(errs) < 1e-10, errs


def checkpointed_varlen(mode: str, compiled: bool):
    """varlen_attn under checkpoint on the ring: backward traffic by tag and fp64 gradient error."""
    from torch.nn.attention.varlen import varlen_attn
    from torch.utils.checkpoint import checkpoint

    import cp_compile
    from cp_compile.sac import sac_context

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel(schedule="ring")
    q, k, v, do, cu = packed_inputs(LENGTHS, 4, 2, 8)
    max_len = max(LENGTHS)

    def block(attention, q, k, v):
        return attention(q.sin(), k * 2, v).cos()

    def run(attention, q, k, v):
        kwargs = {"context_fn": sac_context()} if mode == "sac" else {}
        return checkpoint(block, attention, q, k, v, use_reentrant=False, **kwargs)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    block(lambda q, k, v: per_document_reference_out(q, k, v, cu, (-1, 0)), *ref).backward(do)
    local = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    if compiled:
        gqa = varlen_gqa()

        def single_device(q, k, v):
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **gqa)

        out = torch.compile(lambda *a: run(single_device, *a), backend=plan.backend("aot_eager"), fullgraph=True)(
            *local
        )
    else:
        out = run(
            lambda q, k, v: cp_compile.varlen_attention(q, k, v, cu, is_causal=True, enable_gqa=True, schedule="ring"),
            *local,
        )
    with cp_compile.count_traffic() as backward:
        out.backward(plan.shard(do, 0, cu_seqlens=cu))
    err = max(max_err(a.grad, plan.shard(b.grad, 0, cu_seqlens=cu)) for a, b in zip(local, ref))
    return backward.by_tag, err


@pytest.mark.parametrize("mode,compiled", [("sac", False), ("sac", True), ("plain", True)])
def test_varlen_under_checkpoint_never_reruns_the_ring(ranks, mode, compiled):
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for by_tag, err in ranks(2, checkpointed_varlen, mode, compiled, timeout=300):
        assert err < 1e-10
        assert by_tag == {TAG_KV: 1, TAG_DKV: 2}  # the backward ring alone


def packed_low_precision(dtype_name: str):
    """bf16 CP error against fp64, next to the same-dtype single-device error, per schedule."""
    import cp_compile

    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel()
    q, k, v, do, cu = packed_inputs([50, 7, 1, 33], 4, 2, 32, seed=1)
    window = (-1, 0)
    reference = per_document_reference(q, k, v, do, cu, window)
    single = per_document_reference(*(t.to(dtype) for t in (q, k, v, do)), cu, window)
    shard = lambda t: plan.shard(t, 0, cu_seqlens=cu)  # noqa: E731
    errors = {}
    for schedule in ("allgather", "ring"):
        leaves = [shard(t.to(dtype)).requires_grad_() for t in (q, k, v)]
        out = cp_compile.varlen_attention(*leaves, cu, is_causal=True, enable_gqa=True, schedule=schedule)
        out.backward(shard(do.to(dtype)))
        got = [out.detach()] + [t.grad for t in leaves]
        errors[schedule] = [
            (str(g.dtype), max_err(g, shard(r)), max_err(shard(s), shard(r))) for g, s, r in zip(got, single, reference)
        ]
    return errors


def test_packed_bfloat16_within_twice_single_device_error(ranks):
    for errors in ranks(3, packed_low_precision, "bfloat16"):
        for schedule, per_tensor in errors.items():
            for name, (dtype, cp, single) in zip(("out", "dq", "dk", "dv"), per_tensor):
                assert dtype == "torch.bfloat16"
                assert cp <= 2 * single, f"{schedule} {name}: CP error {cp:.3g} vs single-device {single:.3g}"


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["allgather", "ring"])
def test_packed_expansion_graph(fake_group, schedule):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from cp_compile.compiler.expand import expand_cp_ops
    from cp_compile.compiler.order import pin_overlap_order
    from cp_compile.kinds.packed import PackedSettings

    name, fc = fake_group, torch.ops._c10d_functional
    settings, kind = (name, False, "contiguous", 0.25), ("packed", PackedSettings(4, 0).encode())

    def fwd(q, k, v, cu):
        return getattr(torch.ops.cp, f"{schedule}_attention")(q, k, v, [cu], *settings, True, *kind)

    def bwd(do, q, k, v, out, lse, cu):
        return getattr(torch.ops.cp, f"{schedule}_attention_backward")(
            do, q, k, v, out, lse, None, [cu], *settings, *kind
        )

    with FakeTensorMode():
        q, k, v, do = (torch.empty(s) for s in [(12, 4, 8), (12, 2, 8), (12, 2, 8), (12, 4, 8)])
        cu, lse = torch.empty(4, dtype=torch.int32), torch.empty(12, 4)
        graphs = [
            make_fx(fwd, tracing_mode="fake")(q, k, v, cu),
            make_fx(bwd, tracing_mode="fake")(do, q, k, v, do, lse, cu),
        ]
    (forward,), (backward,) = (expand_cp_ops(gm.graph) for gm in graphs)
    gathers = sum(e.count(fc.all_gather_into_tensor.default) for e in (forward, backward))
    shifts = sum(e.count(torch.ops.cp.ring_shift.default) for e in (forward, backward))
    if schedule == "allgather":
        # K and V side by side: one gather forward, one backward, one reduce-scatter of dK and dV
        assert (gathers, shifts, backward.count(fc.reduce_scatter_tensor.default)) == (2, 0, 1)
    else:  # forward C-1 K/V shifts; backward C-1 K/V and C dK/dV shifts, each but the last overlapped
        assert (gathers, shifts) == (0, 2 + 2 + 3)
        # as the SDPA ring at C=3 (tests/test_graph.py): the backward runs its middle step in head halves
        assert [pin_overlap_order(gm.graph) for gm in graphs] == [5 * 2 + 2, 10 * 2 + 4]
    steps = [n.args[5] for n in forward.nodes if n.target == torch.ops.cp.attend.default]
    assert steps == ([-1] if schedule == "allgather" else [0, 1, 2])  # step numbers, never a rank


def mismatched_cu_seqlens():
    import torch.distributed as dist

    import cp_compile

    lengths = [5, 3] if dist.get_rank() == 0 else [6, 2]  # same total, same local slots: only cu differs
    q, k, v, _, cu = packed_inputs(lengths, 2, 2, 4)
    q, k, v = (packed.shard_packed(t, 0, cu, dist.get_rank(), 2) for t in (q, k, v))
    try:
        cp_compile.varlen_attention(q, k, v, cu, is_causal=True, schedule="ring")
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_cu_seqlens_all_raise(ranks):
    for message in ranks(2, mismatched_cu_seqlens, timeout=60):
        assert message is not None and "cu_seqlens differs across ranks" in message


def test_packed_cost_tiles_count_the_kernels_mask():
    """What the cost model reads for a packed site: visible (query rank, key rank) pairs, in closed form from
    cu_seqlens and the window, equal to counting the mask the kernels evaluate (padding, empty documents,
    lengths that do not divide by 2C, C = 1 included)."""
    from cp_compile.cost.masked import packed_tiles

    def visible_pairs(cu, r, j, c, left, right):
        a, b = packed.packed_slots(cu, r, c), packed.packed_slots(cu, j, c)
        behind = a["pos"][:, None] - b["pos"][None, :]
        mask = (a["doc"][:, None] == b["doc"][None, :]) & a["real"][:, None] & b["real"][None, :]
        if left >= 0:
            mask &= behind <= left
        if right >= 0:
            mask &= -behind <= right
        return int(mask.sum())

    for lengths, c in (([13, 1, 0, 3, 22, 5], 3), ([50, 7, 1, 33], 4), ([9, 17], 2), ([100], 4), ([0, 5], 1)):
        cu = torch.tensor([0] + lengths).cumsum(0).tolist()
        local = packed.packed_local_len(cu, c)
        for window in WINDOWS + [(5, 0), (0, 0), (40, 3)]:
            tiles = packed_tiles(cu, c, *window)
            for r in range(c):
                for j in range(c):
                    pairs = visible_pairs(cu, r, j, c, *window)
                    assert tiles[r][j] == pairs / local**2, (lengths, c, window, r, j)


def test_varlen_with_other_key_documents_is_rejected_at_compile_time():
    from torch.nn.attention.varlen import varlen_attn

    from cp_compile.compiler.rewrite import check_site, find_sites
    from cp_compile.errors import UnsupportedAttention

    def checking_backend(gm, example_inputs):
        for site in find_sites(gm):
            check_site(site)
        return gm.forward

    def cross(q, cu_q, cu_k):
        return varlen_attn(q, q, q, cu_q, cu_k, 4, 4)

    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(cross, backend=checking_backend, fullgraph=True)(q, cu, cu.clone())
    cause = info.value
    while cause is not None and not isinstance(cause, UnsupportedAttention):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert cause is not None and "cu_seq_k" in str(cause)
