"""FlexAttention under CP on real gloo ranks: eager op (forward + backward) and the ring's skipped work."""

import pytest
import torch
from helpers import make_qkv, max_err

CHUNK = 4  # tokens per zigzag chunk: S = 2 * C * CHUNK


def mask_case(name: str, seq: int, chunk: int = CHUNK):
    """(mask_mod, score_mod) over global indices for a named case, the same on every rank."""
    from cp_compile import masks

    if name == "document-causal":
        # documents of odd lengths: they straddle chunk and rank boundaries
        lengths, doc, i = [5, 3, 7, 1, 9], torch.empty(seq, dtype=torch.long), 0
        while i < seq:
            for d, n in enumerate(lengths * seq):
                doc[i : i + n] = d
                i += n
                if i >= seq:
                    break
        return masks.and_(masks.causal(), masks.document(doc)), None
    if name == "window-small":
        return masks.sliding_window(chunk - 1), None
    if name == "window-large":
        return masks.sliding_window(3 * chunk + 1), None
    if name == "prefix-lm":
        return masks.prefix_lm(seq // 3 + 1), None
    if name == "bias-score":
        bias = torch.randn(seq, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx] - 0.5 * bias[kv_idx] + 0.1 * (q_idx - kv_idx)

        return masks.causal(), score_mod
    if name == "full":  # no block_mask at all
        return None, None
    if name == "empty-blocks":
        # two halves that never see each other: whole chunk pairs are empty
        return masks.document((torch.arange(seq) >= seq // 2).long()), None
    raise KeyError(name)


def reference(q, k, v, do, mask_mod, score_mod, scale):
    """Dense single-device attention with the same mask and score (autograd for gradients)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[2]
    qi, ki = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if score_mod is not None:
        b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
        h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(0, 0, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = p @ vv
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_flex_eager(case: str, schedule: str, chunk: int = CHUNK, hq: int = 2, hkv: int = 2):
    """On every rank: the eager op's out, lse and gradients against the dense single-device reference."""
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * chunk
    mask_mod, score_mod = mask_case(case, seq, chunk)
    q, k, v, do = make_qkv(1, hq, hkv, seq, 8, seed=plan.world_size)
    scale = 0.3
    ref = reference(q, k, v, do, mask_mod, score_mod, scale)
    local_mask = None
    if mask_mod is not None:
        local_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=chunk))
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    with cp_compile.count_blocks() as blocks, cp_compile.count_traffic() as traffic:
        out, lse = cp_compile.flex_attention(
            *leaves,
            score_mod=score_mod,
            block_mask=local_mask,
            scale=scale,
            enable_gqa=hq != hkv,
            return_lse=True,
            schedule=schedule,
        )
        out.backward(plan.shard(do, 2))
    got = [out.detach(), lse] + [t.grad for t in leaves]
    return {
        "err": [max_err(g, plan.shard(w, 2)) for g, w in zip(got, [ref[0], ref[1], *ref[2:]])],
        "nan": any(torch.isnan(g).any().item() for g in got[:1] + got[2:]),
        "blocks": (blocks.computed, blocks.skipped),
        "shifts": dict(traffic.by_tag),
        "visible_pairs": visible_chunk_pairs(mask_mod, seq, chunk, plan.positions(seq)) if mask_mod else None,
    }


def visible_chunk_pairs(mask_mod, seq: int, chunk: int, positions) -> int:
    """(local query chunk, any key chunk) pairs with a visible token pair: the work that must be done."""
    qi, ki = positions.view(-1, 1), torch.arange(seq).view(1, -1)
    dense = mask_mod(0, 0, qi, ki)
    return int(dense.view(-1, chunk, seq // chunk, chunk).any(3).any(1).sum())


def run_all_cases(cases):
    return {f"{case} {schedule}": run_flex_eager(case, schedule, *more) for case, schedule, *more in cases}


CASES = ["document-causal", "window-small", "window-large", "prefix-lm", "bias-score"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eager_fp64_forward_backward(ranks, world_size):
    """Every mask, both schedules, against single-device attention with the same mask (out, lse, dq, dk, dv).
    Odd C uses 3-token chunks: lengths divide by 2C and nothing more."""
    chunk = 3 if world_size % 2 else CHUNK
    cases = [(case, "ring", chunk) for case in CASES]
    cases += [("document-causal", "allgather", chunk), ("bias-score", "allgather", chunk, 4, 2)]  # + GQA
    cases += [("full", "ring", chunk), ("full", "allgather", chunk)]
    cases.append(("bias-score", "ring", chunk, 4, 2))
    for per_rank in ranks(world_size, run_all_cases, cases, timeout=600):
        for name, result in per_rank.items():
            assert not result["nan"], name
            assert max(result["err"]) < 1e-10, (name, result["err"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_empty_blocks_skipped_with_identical_collectives(ranks, world_size):
    from cp_compile.comm.ring import TAG_DKV, TAG_KV

    results = ranks(world_size, run_flex_eager, "empty-blocks", "ring")
    for result in results:
        assert max(result["err"]) < 1e-10, result["err"]
        computed, skipped = result["blocks"]
        total = 2 * 2 * world_size  # 2 local chunks x 2C key chunks, per direction
        # exactly the visible chunk pairs are computed (half of them here), forward and backward
        assert computed == {"forward": result["visible_pairs"], "backward": result["visible_pairs"]}
        assert result["visible_pairs"] == total // 2
        assert skipped == {"forward": total // 2, "backward": total // 2}
        # the full ring still runs on every rank: forward C-1 K/V, backward C-1 K/V and C dK/dV
        assert result["shifts"] == {TAG_KV: 2 * (world_size - 1), TAG_DKV: world_size}
    assert all(r["shifts"] == results[0]["shifts"] for r in results)


def run_flex_eager_inside_compile(case: str, fullgraph: bool):
    """cp_compile.flex_attention called in a compiled function, forward and backward, against one device.
    A call with a block_mask from plan.shard traces whole; one with a score_mod breaks the graph where it
    makes its mods (Dynamo cannot create an opaque object)."""
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * CHUNK
    mask_mod, score_mod = mask_case(case, seq)
    q, k, v, do = make_qkv(1, 2, 2, seq, 8, seed=7)
    ref = reference(q, k, v, do, mask_mod, score_mod, 0.3)
    local_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK))

    def attention(q, k, v):
        return cp_compile.flex_attention(
            q * 1.0, k, v, score_mod=score_mod, block_mask=local_mask, scale=0.3, group=plan.group_name, schedule="ring"
        )

    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    out = torch.compile(attention, backend="aot_eager", fullgraph=fullgraph)(*leaves)
    out.backward(plan.shard(do, 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return [max_err(g, plan.shard(w, 2)) for g, w in zip(got, [ref[0], *ref[2:]])]


@pytest.mark.parametrize("case, fullgraph", [("document-causal", True), ("bias-score", False)])
def test_eager_function_inside_compile(ranks, case, fullgraph):
    for errors in ranks(2, run_flex_eager_inside_compile, case, fullgraph):
        assert max(errors) < 1e-10, errors


def run_flex_compiled(inner: str, case: str, dtype_name: str = "float64", checkpoint: bool = False):
    """The compiled rewrite of torch's flex_attention (forward: CPU flex refuses grads under Dynamo)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.utils.checkpoint import checkpoint as ckpt

    import cp_compile
    from cp_compile.compiler.explain import site_report

    torch._dynamo.reset()
    counters.clear()
    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * CHUNK
    mask_mod, score_mod = mask_case(case, seq)
    q, k, v, do = make_qkv(1, 4, 2, seq, 8, seed=plan.world_size)
    ref = reference(q, k, v, do, mask_mod, score_mod, 0.3)
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK)
    single, single_lse = flex_attention(
        *(t.to(dtype) for t in (q, k, v)),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=0.3,
        enable_gqa=True,
        return_lse=True,
    )

    def attend(q, k, v, bm):
        out, lse = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=bm, scale=0.3, enable_gqa=True, return_lse=True
        )
        return out * 2, lse

    fn = (lambda *a: ckpt(attend, *a, use_reentrant=False)) if checkpoint else attend
    backend = plan.backend(inner)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    local = [plan.shard(t.to(dtype), 2) for t in (q, k, v)]
    out, lse = compiled(*local, plan.shard(block_mask))
    return {
        "err": [max_err(out / 2, plan.shard(ref[0], 2)), max_err(lse, plan.shard(ref[1], 2))],
        "single_err": [max_err(single, ref[0]), max_err(single_lse, ref[1])],
        "graph_breaks": sum(counters["graph_break"].values()),
        "sites": [(s.pattern, s.location, s.decision.schedule) for r in backend.records for s in r.sites],
        "listing": [x for r in backend.records for x in r.schedules],
        "explained": [str(site_report(s, plan.world_size)) for r in backend.records for s in r.sites],
    }


def run_compiled_cases(cases):
    return [run_flex_compiled(*case) for case in cases]


def test_compiled_fp64_aot_eager(ranks):
    """fp64 runs with inner="aot_eager": Inductor's CPU flex lowering takes fp32/fp16/bf16 only."""
    cases = [
        ("aot_eager", "document-causal"),
        ("aot_eager", "bias-score", "float64", True),
        ("aot_eager", "window-small"),
        ("aot_eager", "prefix-lm"),
    ]
    for plain, checkpointed, *more in ranks(3, run_compiled_cases, cases, timeout=600):
        for result in (plain, checkpointed, *more):
            assert result["graph_breaks"] == 0
            assert max(result["err"]) < 1e-10, result
        assert [s[:2] for s in plain["sites"]] == [("flex", "top-level graph")]
        assert [s[0] for s in checkpointed["sites"]] == ["flex"] and "inside" in checkpointed["sites"][0][1]
        assert "schedule:" in checkpointed["explained"][0]


def test_compiled_fp32_inductor(ranks):
    """Compiled twice: the second compile of the same graph may find the first in Inductor's caches, which
    must hand the ops the mods again (a cache hit restores no opaque constant: the flex graph is not cached).
    Before torch 2.13, Inductor cannot lower the ops' opaque mods: the backend refuses by name."""
    from cp_compile.tools.launch import RankError
    from cp_compile.torch_compat import inductor_lowers_opaque_objects

    cases = [("inductor", "window-large", "float32")] * 2
    if not inductor_lowers_opaque_objects():
        with pytest.raises(RankError, match="needs torch 2.13 or newer"):
            ranks(2, run_compiled_cases, cases[:1], timeout=600)
        return
    for results in ranks(2, run_compiled_cases, cases, timeout=600):
        for result in results:
            assert result["graph_breaks"] == 0
            for cp, single in zip(result["err"], result["single_err"]):
                assert cp <= 2 * single, result


def opcheck_flex_ops():
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile
    from cp_compile.kinds.flex import FlexSettings, eager_mods

    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * CHUNK
    # mask-only: a score_mod's gradient is taken with torch.func, which cannot run under opcheck's dispatch modes
    mask_mod, _ = mask_case("document-causal", seq)
    local_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK))
    mods, buffers, mb, mh = eager_mods(local_mask, None)
    name = dist.group.WORLD.group_name
    q, k, v, do = (plan.shard(t, 2) for t in make_qkv(1, 2, 1, seq, 8))
    settings = (name, False, "zigzag", 0.3)
    kind = ("flex", FlexSettings(mb, mh).encode(), mods)
    out, lse = torch.ops.cp.ring_attention(q, k, v, buffers, *settings, True, *kind)
    req = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    k_all, v_all = (torch.cat([t] * plan.world_size, 2) for t in (k, v))
    step = lambda i: ("flex", i, name, 1, False, "zigzag", 0.3, *kind[1:])  # noqa: E731
    cases = [
        (torch.ops.cp.ring_attention.default, (*req(q, k, v), buffers, *settings, True, *kind)),
        (torch.ops.cp.allgather_attention.default, (*req(q, k, v), buffers, *settings, True, *kind)),
        (torch.ops.cp.ring_attention_backward.default, (do, q, k, v, out, lse, None, buffers, *settings, *kind)),
        (torch.ops.cp.attend.default, (q, k, v, buffers, *step(1))),
        (torch.ops.cp.attend_backward.default, (do, q, k, v, out, lse, lse, buffers, *step(1))),
        (torch.ops.cp.attend.default, (q, k_all, v_all, buffers, *step(-1))),
        (torch.ops.cp.attend_backward.default, (do, q, k_all, v_all, out, lse, None, buffers, *step(-1))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    return len(cases), score_grad_error_under_a_dispatch_mode(plan, seq, name)


def score_grad_error_under_a_dispatch_mode(plan, seq, name) -> str:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_compile.kinds.flex import FlexSettings, eager_mods

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    mask_mod, score_mod = mask_case("bias-score", seq)
    local_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK))
    mods, buffers, mb, mh = eager_mods(local_mask, score_mod)
    q, k, v, do = (plan.shard(t, 2) for t in make_qkv(1, 2, 1, seq, 8))
    settings, kind = (name, False, "zigzag", 0.3), ("flex", FlexSettings(mb, mh).encode(), mods)
    out, lse = torch.ops.cp.ring_attention(q, k, v, buffers, *settings, True, *kind)
    try:
        with PassThrough():
            torch.ops.cp.ring_attention_backward(do, q, k, v, out, lse, None, buffers, *settings, *kind)
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_opcheck_flex_ops(ranks):
    for checked, score_grad_error in ranks(2, opcheck_flex_ops):
        assert checked == 7
        assert "score_mod" in score_grad_error and "dispatch mode" in score_grad_error


def test_schedule_choice_from_global_block_counts():
    """The cost model reads the tiles the shard records from the global block counts. Short documents leave
    most remote tiles empty, so most ring steps would wait on transfers: all-gather (or Ulysses, balanced
    whatever the mask, when the heads split over C and K/V are as many as queries); a prefix-LM mask keeps
    every ring step busy: ring. The tiles are fractions; the workload is the same mask at 4096 tokens a rank."""
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_compile import masks
    from cp_compile.cost.masked import MaskFacts, choose_masked
    from cp_compile.cost.model import MACHINES
    from cp_compile.layout import layout_named
    from cp_compile.layout.blockmask import tile_counts, tile_fractions

    c, seq = 4, 32
    perm = layout_named("zigzag").all_positions(seq, c)
    docs = masks.document(torch.arange(seq) // (2 * CHUNK))  # each document is two adjacent chunks
    chosen = {}
    for name, mod in {"documents": docs, "prefix-lm": masks.prefix_lm(seq // 2)}.items():
        bm = create_block_mask(mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK)
        facts = MaskFacts(tile_fractions(tile_counts(bm, perm, c), c), "test mask")
        for hq, hkv in ((12, 2), (8, 8)):
            shapes = [(1, h, 4096, 128) for h in (hq, hkv, hkv)]
            chosen[name, hq, hkv] = choose_masked(
                "flex", *shapes, torch.bfloat16, c, facts, causal=False, backward=True, machine=MACHINES["cuda"]
            )[:2]
    schedule, why = chosen["documents", 12, 2]
    assert schedule == "allgather" and "4 of 12 remote tiles" in why, why
    assert chosen["documents", 8, 8][0] == "ulysses"
    assert chosen["prefix-lm", 12, 2][0] == "ring"


def run_balanced(seq: int = 48, block: int = 4):
    """Per-rank visible blocks under zigzag and under the mask-balanced layout; the balanced run's accuracy."""
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile
    from cp_compile import masks

    doc = torch.cat([torch.full((n,), d) for d, n in enumerate([28, 8, 12])])
    mask_mod = masks.and_(masks.causal(), masks.document(doc))
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=block)
    zigzag = cp_compile.ContextParallel()
    plan = cp_compile.ContextParallel(load_balance=block_mask)
    q, k, v, do = make_qkv(1, 2, 2, seq, 8, seed=5)
    ref = reference(q, k, v, do, mask_mod, None, 0.3)
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    with cp_compile.count_blocks() as blocks:
        out = cp_compile.flex_attention(*leaves, block_mask=plan.shard(block_mask), scale=0.3)
        out.backward(plan.shard(do, 2))
    got = [out.detach()] + [t.grad for t in leaves]
    return {
        "zigzag": visible_chunk_pairs(mask_mod, seq, block, zigzag.positions(seq)),
        "balanced": visible_chunk_pairs(mask_mod, seq, block, plan.positions(seq)),
        "computed": blocks.computed["forward"],
        "err": [max_err(g, plan.shard(w, 2)) for g, w in zip(got, [ref[0], *ref[2:]])],
        "roundtrip": bool(torch.equal(plan.unshard(plan.shard(q, 2), 2), q)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_mask_balanced_layout(ranks, world_size):
    results = ranks(world_size, run_balanced)
    zigzag, balanced = [r["zigzag"] for r in results], [r["balanced"] for r in results]
    assert max(balanced) - min(balanced) <= 2, balanced  # visible blocks per rank, nearly equal
    assert max(balanced) < max(zigzag), (balanced, zigzag)
    for r in results:
        assert r["computed"] == r["balanced"]  # exactly the visible blocks are computed
        assert max(r["err"]) < 1e-10 and r["roundtrip"]


@pytest.fixture
def fake_group(request):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param, dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_group", [3], indirect=True)
def test_expanded_flex_schedules(fake_group):
    """Stage 2 traces the same schedules: the ring as in SDPA (also its backward, which CPU compile
    cannot reach), the all-gather as one gathered tile."""
    from test_graph import expected_backward, expected_forward
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from cp_compile.compiler.expand import expand_cp_ops
    from cp_compile.compiler.order import schedule_listing
    from cp_compile.kinds.flex import NO_MODS, FlexSettings

    c, name = fake_group
    settings, kind = (name, False, "zigzag", 0.25), ("flex", FlexSettings(1, 1).encode(), NO_MODS)

    def traced(fn, *shapes):
        with FakeTensorMode():
            gm = make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes])
        expand_cp_ops(gm.graph)
        return schedule_listing(gm.graph)

    qkv = [(1, 2, 8, 4)] * 3

    def forward(schedule):
        op = getattr(torch.ops.cp, f"{schedule}_attention")
        return lambda q, k, v: op(q, k, v, [], *settings, True, *kind)[0]

    fwd = {s: traced(forward(s), *qkv) for s in ("ring", "allgather")}
    assert fwd["ring"] == expected_forward(c)
    assert fwd["allgather"] == ["agree", "gather", "wait", "gathered attend"]  # K and V gathered together, one tile
    bwd = traced(
        lambda do, q, k, v, o, lse: torch.ops.cp.ring_attention_backward(
            do, q, k, v, o, lse, None, [], *settings, *kind
        ),
        *qkv,
        (1, 2, 8, 4),
        (1, 2, 8, 4),
        (1, 2, 8),
    )
    assert bwd == expected_backward(c, halves=False)  # a score_mod may read the head index: no split
