"""Ulysses (all-to-all) with FlexAttention masks and packed documents, on real gloo ranks, fp64."""

import pytest
import torch
from helpers import make_qkv, max_err, varlen_gqa
from test_flex import mask_case, run_flex_eager
from test_flex import reference as flex_reference
from test_varlen import LENGTHS, WINDOWS, packed_inputs, per_document_reference, per_document_reference_out

from cp_compile.layout import packed

# ----------------------------------------------------------------------------
# FlexAttention masks.
# ----------------------------------------------------------------------------


def run_flex_cases(cases):
    return {f"{case} hq={hq} hkv={hkv}": run_flex_eager(case, "ulysses", 3, hq, hkv) for case, hq, hkv in cases}


@pytest.mark.parametrize("world_size", [2, 4])
def test_flex_fp64_forward_backward(ranks, world_size):
    """Document + causal mask (odd document lengths straddling ranks), a score_mod, no mask; GQA with
    K/V heads that divide by C and (C=4) ones that are replicated: out, lse, dq, dk, dv."""
    cases = [("document-causal", 4, 4), ("document-causal", 4, 2), ("bias-score", 4, 1), ("full", 4, 2)]
    for per_rank in ranks(world_size, run_flex_cases, cases, timeout=300):
        assert set(per_rank) == {f"{c} hq={hq} hkv={hkv}" for c, hq, hkv in cases}
        for name, result in per_rank.items():
            assert not result["nan"], name
            assert max(result["err"]) < 1e-10, (name, result["err"])
            assert result["shifts"] == {}, name  # no ring traffic: all-to-alls only


def run_flex_head_mask(chunk: int = 3, heads: int = 4, mesh=None):
    """A mask that differs per head: each rank's heads must see their global head index.
    With ``mesh`` (ring, a2a): the hybrid schedule on that 2-D mesh."""
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    group, schedule = None, "ulysses"
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        group, schedule = init_device_mesh("cpu", mesh, mesh_dim_names=("ring", "a2a")), "hybrid"
    plan = cp_compile.ContextParallel(group)
    seq = 2 * plan.world_size * chunk

    def mask_mod(b, h, q_idx, kv_idx):  # head h sees h + 1 keys back, causal
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= h + 1)

    q, k, v, do = make_qkv(1, heads, heads, seq, 8, seed=7)
    scale = 0.3
    ref = head_mask_reference(q, k, v, do, mask_mod, scale)
    block_mask = plan.shard(create_block_mask(mask_mod, None, heads, seq, seq, device="cpu", BLOCK_SIZE=chunk))
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    out, lse = cp_compile.flex_attention(
        *leaves, block_mask=block_mask, scale=scale, return_lse=True, group=group, schedule=schedule
    )
    out.backward(plan.shard(do, 2))
    got = [out.detach(), lse] + [t.grad for t in leaves]
    return [max_err(g, plan.shard(w, 2)) for g, w in zip(got, ref)]


def head_mask_reference(q, k, v, do, mask_mod, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[2]
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    visible = mask_mod(0, h, torch.arange(seq).view(1, 1, -1, 1), torch.arange(seq).view(1, 1, 1, -1))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world_size,mesh", [(2, None), (4, (2, 2))])
def test_flex_head_dependent_mask(ranks, world_size, mesh):
    for errors in ranks(world_size, run_flex_head_mask, 3, 4, mesh):
        assert max(errors) < 1e-10, errors


def run_flex_hybrid(cases, chunk: int = 3):
    """flex_attention(..., schedule="hybrid") on a (2, 2) mesh against the dense single-device reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "a2a"))
    plan = cp_compile.ContextParallel(mesh)
    seq = 2 * plan.world_size * chunk
    results = {}
    for case, hq, hkv in cases:
        mask_mod, score_mod = mask_case(case, seq, chunk)
        q, k, v, do = make_qkv(1, hq, hkv, seq, 8, seed=5)
        ref = flex_reference(q, k, v, do, mask_mod, score_mod, 0.3)
        block_mask = None
        if mask_mod is not None:
            global_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=chunk)
            block_mask = plan.shard(global_mask)
        leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
        with cp_compile.count_traffic() as traffic:
            out, lse = cp_compile.flex_attention(
                *leaves,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=0.3,
                enable_gqa=hq != hkv,
                return_lse=True,
                group=mesh,
                schedule="hybrid",
            )
            out.backward(plan.shard(do, 2))
        got = [out.detach(), lse] + [t.grad for t in leaves]
        results[(case, hq, hkv)] = {
            "err": [max_err(g, plan.shard(w, 2)) for g, w in zip(got, ref)],
            "nan": any(torch.isnan(g).any().item() for g in got[:1] + got[2:]),
            "shifts": dict(traffic.by_tag),
        }
    return results


def test_flex_hybrid_2x2(ranks):
    """Document + causal (GQA, K/V heads divide by the all-to-all size), a score_mod with one K/V head
    (replicated inside each group), no mask; forward and backward."""
    cases = [("document-causal", 4, 2), ("bias-score", 2, 1), ("full", 2, 2)]
    for per_rank in ranks(4, run_flex_hybrid, cases, timeout=300):
        assert set(per_rank) == set(cases)
        for case, result in per_rank.items():
            assert not result["nan"], case
            assert max(result["err"]) < 1e-10, (case, result["err"])
            assert result["shifts"], case  # K/V travel the ring across groups


def _compiled_plan(mesh):
    """A plan forcing Ulysses, or with ``mesh`` (ring, a2a) the hybrid schedule on that 2-D mesh."""
    import cp_compile

    if mesh is None:
        return cp_compile.ContextParallel(schedule="ulysses")
    from torch.distributed.device_mesh import init_device_mesh

    return cp_compile.ContextParallel(init_device_mesh("cpu", mesh, mesh_dim_names=("ring", "a2a")), schedule="hybrid")


def all_to_alls(backend, direction: str) -> list[int]:
    """All-to-alls per expanded CP op of ``direction`` in the backend's compiled graphs."""
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    return [e.count(a2a) for r in backend.records for e in r.expansions if e.direction == direction]


def run_flex_compiled_ulysses(mesh=None):
    """torch's flex_attention in a compiled function, rewritten to the Ulysses schedule, or with
    ``mesh`` to the hybrid one (forward: CPU flex refuses gradients under Dynamo)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    counters.clear()
    plan = _compiled_plan(mesh)
    seq = 2 * plan.world_size * 3
    mask_mod, _ = mask_case("document-causal", seq, 3)
    q, k, v, do = make_qkv(1, 4, 2, seq, 8, seed=1)
    ref = flex_reference(q, k, v, do, mask_mod, None, 0.3)
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=3)

    def attend(q, k, v, bm):
        out, lse = flex_attention(q, k, v, block_mask=bm, scale=0.3, enable_gqa=True, return_lse=True)
        return out * 2, lse

    backend = plan.backend("aot_eager")
    out, lse = torch.compile(attend, backend=backend, fullgraph=True)(
        *(plan.shard(t, 2) for t in (q, k, v)), plan.shard(block_mask)
    )
    return {
        "err": [max_err(out / 2, plan.shard(ref[0], 2)), max_err(lse, plan.shard(ref[1], 2))],
        "graph_breaks": sum(counters["graph_break"].values()),
        "schedules": [s.decision.schedule for r in backend.records for s in r.sites],
        "listings": [listing for r in backend.records for listing in r.schedules],
        "forward_all_to_alls": all_to_alls(backend, "forward"),
    }


def test_compiled_flex_ulysses(ranks):
    for result in ranks(2, run_flex_compiled_ulysses, timeout=300):
        assert result["schedules"] == ["ulysses"]
        assert result["graph_breaks"] == 0
        assert max(result["err"]) < 1e-10, result["err"]


def test_compiled_flex_hybrid_2x2(ranks):
    """A document mask on a (2, 2) mesh plan with schedule="hybrid": the flex site becomes the hybrid
    op, expanded into the all-to-alls and a 2-step ring of mask tiles."""
    per_rank = ranks(4, run_flex_compiled_ulysses, (2, 2), timeout=300)
    for result in per_rank:
        assert result["schedules"] == ["hybrid"]
        assert result["graph_breaks"] == 0
        assert max(result["err"]) < 1e-10, result["err"]
        assert result["forward_all_to_alls"] == [5]  # q, k, v in; out, lse back
        assert result["listings"] == per_rank[0]["listings"]  # no rank in the graph
    (listing,) = per_rank[0]["listings"]
    assert ["attend step=0", "attend step=1"] == [x for x in listing if x.startswith("attend")]
    assert "shift" in listing


# ----------------------------------------------------------------------------
# Packed documents.
# ----------------------------------------------------------------------------


def run_packed_ulysses(lengths, hq, hkv, d, mesh=None):
    """Every window on this rank: fp64 errors against per-document attention, padding rows zero.
    With ``mesh`` (ring, a2a): the hybrid schedule on that 2-D mesh."""
    import cp_compile

    group, schedule = None, "ulysses"
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        group, schedule = init_device_mesh("cpu", mesh, mesh_dim_names=("ring", "a2a")), "hybrid"
    plan = cp_compile.ContextParallel(group)
    q, k, v, do, cu = packed_inputs(lengths, hq, hkv, d)
    pad = ~packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
    results = []
    for window in WINDOWS:
        reference = per_document_reference(q, k, v, do, cu, window)
        leaves = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
        # gradients arriving at padding rows must not leak anywhere
        local_do = plan.shard(do, 0, cu_seqlens=cu) + pad[:, None, None] * torch.randn(len(pad), hq, d)
        with cp_compile.count_traffic() as traffic:
            out = cp_compile.varlen_attention(
                *leaves, cu, group=group, window_size=window, enable_gqa=hq != hkv, schedule=schedule
            )
            out.backward(local_do)
        got = [out.detach()] + [t.grad for t in leaves]
        results.append(
            {
                "window": window,
                "errors": [max_err(g, plan.shard(r, 0, cu_seqlens=cu)) for g, r in zip(got, reference)],
                "unshard_err": max_err(plan.unshard(out.detach(), 0, cu_seqlens=cu), reference[0]),
                "nan": any(not torch.isfinite(g).all().item() for g in got),
                "padding_zero": all((g[pad] == 0).all().item() for g in got),
                "shifts": dict(traffic.by_tag),
                "has_padding": bool(pad.any()),
            }
        )
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hkv", [4, 2])
def test_packed_fp64_equals_per_document_attention(ranks, world_size, hkv):
    """Lengths that do not divide by 2C, a zero-length and a length-1 document; every window kind.
    hkv=2 at C=4 replicates the K/V heads before the exchange."""
    for per_rank in ranks(world_size, run_packed_ulysses, LENGTHS, 4, hkv, 6, timeout=300):
        assert len(per_rank) == len(WINDOWS)
        for result in per_rank:
            case = result["window"]
            assert result["has_padding"], case
            assert not result["nan"], case
            assert result["padding_zero"], case  # padding rows: out = 0, dq = dk = dv = 0
            assert max(result["errors"]) < 1e-10, (case, result["errors"])
            assert result["unshard_err"] < 1e-10, case
            assert result["shifts"] == {}, case


@pytest.mark.parametrize("hkv", [4, 1])
def test_packed_hybrid_2x2(ranks, hkv):
    """Ring of 2 all-to-all groups of 2; hkv=1 replicates the K/V head inside each group."""
    for per_rank in ranks(4, run_packed_ulysses, LENGTHS, 4, hkv, 6, (2, 2), timeout=300):
        assert len(per_rank) == len(WINDOWS)
        for result in per_rank:
            case = result["window"]
            assert not result["nan"], case
            assert result["padding_zero"], case
            assert max(result["errors"]) < 1e-10, (case, result["errors"])
            assert result["unshard_err"] < 1e-10, case
            assert result["shifts"], case  # K/V (and dK/dV) travel the ring across groups


def compiled_ulysses_varlen(mesh=None):
    """torch's varlen_attn in a compiled model, rewritten to the Ulysses schedule, or with ``mesh``
    to the hybrid one (aot_eager): fp64 errors of out and gradients, and the expanded graphs."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.varlen import varlen_attn

    plan = _compiled_plan(mesh)
    q, k, v, do, cu = packed_inputs(LENGTHS, 4, 2, 8)
    max_len = max(LENGTHS)

    gqa = varlen_gqa()

    def model(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(2, 0), **gqa)

    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = per_document_reference_out(*ref_inputs, cu, (2, 0))
    ref_out.backward(do)
    torch._dynamo.reset()
    counters.clear()
    backend = plan.backend("aot_eager")
    local = [plan.shard(t, 0, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    out = torch.compile(model, backend=backend, fullgraph=True)(*local, cu)
    out.backward(plan.shard(do, 0, cu_seqlens=cu))
    errs = [max_err(out, plan.shard(ref_out.detach(), 0, cu_seqlens=cu))]
    errs += [max_err(a.grad, plan.shard(b.grad, 0, cu_seqlens=cu)) for a, b in zip(local, ref_inputs)]
    return {
        "errs": errs,
        "decisions": [(s.pattern, s.decision.schedule) for r in backend.records for s in r.sites],
        "graph_breaks": sum(counters["graph_break"].values()),
        "all_to_alls": (all_to_alls(backend, "forward"), all_to_alls(backend, "backward")),
        "listings": [listing for r in backend.records for listing in r.schedules],
    }


@pytest.mark.parametrize("world_size,mesh", [(2, None), (4, (2, 2))])
def test_compiled_varlen_ulysses(ranks, world_size, mesh):
    """Compiled forward and backward; the backward graph exchanges only dout in and dq, dk, dv out.
    On the (2, 2) mesh with schedule="hybrid" the varlen site becomes the hybrid op."""
    per_rank = ranks(world_size, compiled_ulysses_varlen, mesh, timeout=300)
    for result in per_rank:
        assert result["decisions"] == [("varlen", "ulysses" if mesh is None else "hybrid")]
        assert result["graph_breaks"] == 0
        assert max(result["errs"]) < 1e-10, result["errs"]
        assert result["all_to_alls"] == ([5], [4])
        assert result["listings"] == per_rank[0]["listings"]
    if mesh is not None:
        forward, backward = per_rank[0]["listings"]
        assert [x for x in forward if "attend" in x] == ["attend step=0", "attend step=1"]
        assert [x for x in backward if "attend" in x] == ["attend_backward step=0", "attend_backward step=1"]


def test_heads_not_dividing_by_c_named(ranks):
    for message in ranks(4, packed_with_too_few_heads):
        assert "heads" in message and "C=4" in message


def packed_with_too_few_heads():
    import cp_compile

    plan = cp_compile.ContextParallel()
    q, k, v, _, cu = packed_inputs([5, 3], 2, 2, 4)
    q, k, v = (plan.shard(t, 0, cu_seqlens=cu) for t in (q, k, v))
    try:
        cp_compile.varlen_attention(q, k, v, cu, schedule="ulysses")
    except ValueError as e:
        return str(e)
    return "no error"


# ----------------------------------------------------------------------------
# What the backward sends: the head-sharded tensors are kept, not exchanged again.
# ----------------------------------------------------------------------------


def backward_traffic(mesh=None):
    """All-to-alls (forward, backward) and backward ring transfers of eager flex and packed calls
    with the head-sharding schedule: Ulysses over the whole group, or hybrid on a (ring, a2a) mesh."""
    from helpers import count_all_to_alls
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    group, schedule = None, "ulysses"
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        group, schedule = init_device_mesh("cpu", mesh, mesh_dim_names=("ring", "a2a")), "hybrid"
    plan = cp_compile.ContextParallel(group)
    seq = 2 * plan.world_size * 3
    mask_mod, _ = mask_case("document-causal", seq, 3)
    block_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=3))
    q, k, v, do = make_qkv(1, 4, 1, seq, 8)  # one K/V head: replicated before the exchange
    pq, pk, pv, pdo, cu = packed_inputs(LENGTHS, 4, 2, 6)

    def flex_loss(q, k, v, with_lse):
        out, lse = cp_compile.flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True, group=group, schedule=schedule
        )
        return (out * plan.shard(do, 2)).sum() + (lse.sum() if with_lse else 0)

    def packed_loss(q, k, v, _):
        out = cp_compile.varlen_attention(
            q, k, v, cu, group=group, window_size=(3, 0), enable_gqa=True, schedule=schedule
        )
        return (out * plan.shard(pdo, 0, cu_seqlens=cu)).sum()

    cases = {
        "flex": (flex_loss, [plan.shard(t, 2) for t in (q, k, v)], False),
        "flex+lse": (flex_loss, [plan.shard(t, 2) for t in (q, k, v)], True),
        "packed": (packed_loss, [plan.shard(t, 0, cu_seqlens=cu) for t in (pq, pk, pv)], False),
    }
    results = {}
    for name, (loss_fn, inputs, with_lse) in cases.items():
        leaves = [t.requires_grad_() for t in inputs]
        with count_all_to_alls() as forward:
            loss = loss_fn(*leaves, with_lse)
        with count_all_to_alls() as backward, cp_compile.count_traffic() as ring:
            loss.backward()
        results[name] = {
            "forward": len(forward),
            "backward": len(backward),
            "ring": dict(ring.by_tag),
            "grads": all(t.grad is not None and torch.isfinite(t.grad).all().item() for t in leaves),
        }
    return results


@pytest.mark.parametrize("world_size,mesh", [(2, None), (4, (2, 2))])
def test_backward_moves_only_gradients(ranks, world_size, mesh):
    """The forward exchanges q, k, v in and out, lse back (5 all-to-alls); the backward only dout in
    and dq, dk, dv out (4), plus dlse in when lse is differentiated (5): the head-sharded q, k, v,
    out and lse are kept from the forward, never exchanged again. On the hybrid mesh the backward's
    ring is the K/V ring's own: K/V R-1 times, dK/dV R times."""
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    for per_case in ranks(world_size, backward_traffic, mesh, timeout=300):
        for name, result in per_case.items():
            assert result["grads"], name
            assert result["forward"] == 5, (name, result)
            assert result["backward"] == (5 if name == "flex+lse" else 4), (name, result)
            assert result["ring"] == ({} if mesh is None else {TAG_KV: 1, TAG_DKV: 2}), (name, result)


# ----------------------------------------------------------------------------
# opcheck.
# ----------------------------------------------------------------------------


def opcheck_ulysses_mask_ops():
    """The head-sharding ops with the "packed" and "flex" inner attentions, on [1, H, T, D] views
    of packed tensors and on [B, H, S, D] flex shards."""
    import torch.distributed as dist

    import cp_compile

    layout = "packed"  # what packed calls name: per-document zigzag, exchanged in rank order
    from cp_compile.kinds.packed import PackedSettings
    from cp_compile.kinds.packed import bhsd as _bhsd

    plan = cp_compile.ContextParallel()
    name, c = dist.group.WORLD.group_name, plan.world_size
    q, k, v, do, cu = packed_inputs([5, 1, 0, 3], 4, 2, 6)
    q, k, v, do = (_bhsd(plan.shard(t, 0, cu_seqlens=cu)) for t in (q, k, v, do))
    cases = head_sharding_cases(q, k, v, do, [cu], (name,), layout, "packed", PackedSettings(2, 0).encode(), c)
    cases += flex_head_sharding_cases(plan, (name,), c)
    for op, args in cases:
        torch.library.opcheck(op, args)
    return len(cases)


def head_sharding_cases(q, k, v, do, extra, groups, layout, inner, options, a2a, mods=None):
    """opcheck cases of a head-sharding whole op (Ulysses: one group; hybrid: flat, ring, a2a), its
    backward and (Ulysses) the inner kernel ops."""
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    forward = torch.ops.cp.ulysses_attention if len(groups) == 1 else torch.ops.cp.hybrid_attention
    backward = torch.ops.cp.ulysses_attention_backward if len(groups) == 1 else torch.ops.cp.hybrid_attention_backward
    settings = (False, layout, 0.4)
    kind = (inner, options) if mods is None else (inner, options, mods)
    out, lse, qh, kh, vh, out_h, lse_h = forward(q, k, v, extra, *groups, *settings, True, *kind)
    cases = [
        (forward.default, (*req(q, k, v), extra, *groups, *settings, True, *kind)),
        (backward.default, (do, lse, qh, kh, vh, out_h, lse_h, extra, *groups, *settings, k.shape[1], *kind)),
    ]
    if len(groups) == 1:
        doh = torch.cat([do[:, : do.shape[1] // a2a]] * a2a, 2)
        heads = (extra, inner, -2, groups[0], a2a, False, layout, 0.4, *kind[1:])  # step WHOLE
        cases += [
            (torch.ops.cp.attend.default, (qh, kh, vh, *heads)),
            (torch.ops.cp.attend_backward.default, (doh, qh, kh, vh, out_h, lse_h, None, *heads)),
        ]
    return cases


def flex_head_sharding_cases(plan, groups, a2a):
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_compile.kinds.flex import FlexSettings, eager_mods

    seq = 2 * plan.world_size * 3
    mask_mod, _ = mask_case("document-causal", seq, 3)
    block_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=3))
    mods, buffers, mb, mh = eager_mods(block_mask, None)
    q, k, v, do = (plan.shard(t, 2) for t in make_qkv(1, 4, 2, seq, 8))
    return head_sharding_cases(q, k, v, do, buffers, groups, "zigzag", "flex", FlexSettings(mb, mh).encode(), a2a, mods)


def test_opcheck(ranks):
    assert ranks(2, opcheck_ulysses_mask_ops) == [8, 8]


def opcheck_hybrid_ops():
    from torch.distributed.device_mesh import init_device_mesh

    import cp_compile
    from cp_compile.comm.groups import mesh_groups

    layout = "packed"  # what packed calls name: per-document zigzag, exchanged in rank order
    from cp_compile.kinds.packed import PackedSettings
    from cp_compile.kinds.packed import bhsd as _bhsd

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "a2a"))
    plan = cp_compile.ContextParallel(mesh)
    flat, ring, a2a = mesh_groups(mesh)
    q, k, v, do, cu = packed_inputs([5, 1, 0, 3], 4, 2, 6)
    q, k, v, do = (_bhsd(plan.shard(t, 0, cu_seqlens=cu)) for t in (q, k, v, do))
    window = (2, 0)
    cases = head_sharding_cases(
        q, k, v, do, [cu], (flat, ring, a2a), layout, "packed", PackedSettings(*window).encode(), 2
    )
    # one all-to-all group's slots for this rank's heads: [1, H/A, A*T_local, D]
    qh, kh, vh, doh = (torch.cat([t[:, : t.shape[1] // 2]] * 2, 2) for t in (q, k, v, do))
    step = ([cu], "packed", 1, flat, 2, False, layout, 0.4, PackedSettings(*window).encode())
    out_h, lse_h = torch.ops.cp.attend(qh, kh, vh, *step)
    cases += [
        (torch.ops.cp.attend.default, (qh, kh, vh, *step)),
        (torch.ops.cp.attend_backward.default, (doh, qh, kh, vh, out_h, lse_h, None, *step)),
    ]
    cases += flex_hybrid_opcheck_cases(plan, mesh)
    for op, args in cases:
        torch.library.opcheck(op, args)
    return len(cases)


def flex_hybrid_opcheck_cases(plan, mesh):
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_compile.comm.groups import mesh_groups
    from cp_compile.kinds.flex import FlexSettings, eager_mods

    flat, ring, a2a = mesh_groups(mesh)
    cases = flex_head_sharding_cases(plan, (flat, ring, a2a), 2)
    seq = 2 * plan.world_size * 3
    mask_mod, _ = mask_case("document-causal", seq, 3)
    block_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=3))
    mods, buffers, mb, mh = eager_mods(block_mask, None)
    q, k, v, do = (plan.shard(t, 2) for t in make_qkv(1, 4, 2, seq, 8))
    # one all-to-all group's tokens for this rank's heads
    qh, kh, vh, doh = (torch.cat([t[:, : t.shape[1] // 2]] * 2, 2) for t in (q, k, v, do))
    step_opts = ("flex", 1, flat, 2, False, "zigzag", 0.3, FlexSettings(mb, mh).encode(), mods)
    out_h, lse_h = torch.ops.cp.attend(qh, kh, vh, buffers, *step_opts)
    return cases + [
        (torch.ops.cp.attend.default, (qh, kh, vh, buffers, *step_opts)),
        (torch.ops.cp.attend_backward.default, (doh, qh, kh, vh, out_h, lse_h, None, buffers, *step_opts)),
    ]


def test_opcheck_hybrid(ranks):
    assert ranks(4, opcheck_hybrid_ops) == [8] * 4
