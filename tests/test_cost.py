"""The cost model: per-schedule estimates, the choice, its explanation, and the same choice on every rank."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers import varlen_gqa
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import cp_compile
from cp_compile.compiler.expand import expand_cp_ops
from cp_compile.compiler.order import schedule_listing
from cp_compile.cost.model import (
    ESTIMATORS,
    MACHINES,
    SCHEDULES,
    Machine,
    Workload,
    estimate_all,
    pick,
)


def workload(c=4, hq=32, hkv=8, s_local=4096, d=128, dtype=torch.bfloat16, causal=True, mesh=(), backward=True):
    return Workload(1, hq, hkv, s_local, d, d, dtype, c, 0.5 if causal else 1.0, causal, backward, mesh)


def test_every_schedule_has_an_estimator():
    assert set(SCHEDULES) == set(ESTIMATORS)


def test_ulysses_infeasible_when_heads_do_not_split():
    rows = {e.schedule: e for e in estimate_all(workload(c=3, hq=8, hkv=8), MACHINES["cuda"])}
    assert not rows["ulysses"].feasible and "8 query heads do not split over 3 ranks" in rows["ulysses"].reason
    assert not rows["hybrid"].feasible and "2-D mesh" in rows["hybrid"].reason
    assert rows["ring"].feasible


def test_kv_replication_is_noted():
    rows = {e.schedule: e for e in estimate_all(workload(c=4, hq=8, hkv=2), MACHINES["cuda"])}
    assert rows["ulysses"].feasible and any("replicated x2 (2 -> 4)" in n for n in rows["ulysses"].notes)


def test_choices_follow_the_regimes():
    gpu = MACHINES["cuda"]
    # long local sequence: compute hides the ring's transfers; Ulysses' exposed all-to-alls cost more
    assert pick(estimate_all(workload(c=2, s_local=16384), gpu)).schedule == "ring"
    # short local sequence at large C: the ring's C-1 transfers are exposed; one all-to-all wins
    assert pick(estimate_all(workload(c=8, hkv=32, s_local=256), gpu)).schedule == "ulysses"
    # few K/V heads (GQA 32/8): gathering K/V moves less than exchanging q, k, v and out
    assert pick(estimate_all(workload(c=8, s_local=256), gpu)).schedule == "allgather"
    # large C, heads that do not split over C but split over the all-to-all dim of a mesh: hybrid
    est = estimate_all(workload(c=16, hq=8, hkv=8, s_local=512, mesh=(2, 8)), gpu)
    assert pick(est).schedule == "hybrid"
    # a memory limit rules candidates out, and says so
    tight = Machine("cuda", 400e12, 150e9, 15e-6, memory_limit=1.0)
    with pytest.raises(ValueError, match="over the limit"):
        pick(estimate_all(workload(), tight))


def test_choice_is_deterministic_and_prefers_the_earlier_name_on_ties():
    w = workload(c=1)
    first = [e.schedule for e in estimate_all(w, MACHINES["cpu"])]
    assert first == [e.schedule for e in estimate_all(w, MACHINES["cpu"])]
    assert pick(estimate_all(w, MACHINES["cpu"], available={"ring", "ulysses"})).schedule == "ring"


@pytest.fixture
def fake_group(request):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param, dist.group.WORLD.group_name
    dist.destroy_process_group()


def traced(fn, *shapes):
    with FakeTensorMode():
        return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes])


@pytest.mark.parametrize("fake_group", [2, 4], indirect=True)
def test_ulysses_graph_holds_no_rank(fake_group):
    c, name = fake_group

    def forward(q, k, v):
        return torch.ops.cp.ulysses_attention(q, k, v, [], name, True, "zigzag", 0.25, True, "sdpa", "")[0]

    gm = traced(forward, (1, 8, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    (expansion,) = expand_cp_ops(gm.graph)
    # agree, q/k/v in (K/V heads replicated x2 at C=4), attention, out and lse back
    assert (
        schedule_listing(gm.graph)
        == ["agree"] + ["all_to_all", "wait"] * 3 + ["heads_attend"] + ["all_to_all", "wait"] * 2
    )
    for node in gm.graph.nodes:
        if node.target == torch.ops._c10d_functional.all_to_all_single.default:
            assert node.args[1] == node.args[2] == [1] * c and node.args[3] == name


def calibrated_machine():
    plan = cp_compile.ContextParallel(calibrate=True)
    return plan.machine


def test_calibration_gives_every_rank_the_same_profile(ranks):
    machines = ranks(2, calibrated_machine)
    assert machines[0] == machines[1]  # max-reduced over the group: the choice cannot differ by rank
    m = machines[0]
    assert m.source == "calibrated" and m.flops > 0 and m.bandwidth > 0 and m.latency > 0


# ----------------------------------------------------------------------------
# Masked sites: packed documents and FlexAttention.
# ----------------------------------------------------------------------------


def packed_choice(lengths, window, hq, hkv, c=8, machine="cuda"):
    """(schedule, reason, estimates by name) of a packed site over documents of ``lengths``, from cu_seqlens."""
    from cp_compile.cost.masked import choose_masked, packed_facts
    from cp_compile.layout.packed import packed_local_len

    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    local = packed_local_len(cu, c)
    facts = packed_facts(cu, local, c, window)
    shapes = [(local, h, 128) for h in (hq, hkv, hkv)]
    schedule, why, estimates = choose_masked(
        "packed", *shapes, torch.bfloat16, c, facts, causal=window[1] == 0, backward=True, machine=MACHINES[machine]
    )
    return schedule, why, {e.schedule: e for e in estimates}


def test_masked_choices_follow_the_regimes():
    docs = [16384] * 8  # 16384 slots a rank at C=8: chunks of 1024 per document and rank
    # a window shorter than a chunk: only the neighbouring ranks' K/V are visible, 5 of 8 ring steps are
    # empty and their transfers exposed; one gather moves the same bytes with fewer latencies
    schedule, why, rows = packed_choice(docs, (128, 0), 12, 12)
    assert schedule == "allgather" and "window (128, 0) over 8 documents" in why
    assert any("5 of 8 ring steps have no visible work" in n for n in rows["ring"].notes)
    assert rows["ring"].compute_s < rows["allgather"].exposed_comm_s  # latency/bandwidth-bound, not compute
    # long causal documents: every step has work to hide (part of) the next transfer under
    schedule, why, rows = packed_choice(docs, (-1, 0), 12, 12)
    assert schedule == "ring" and rows["ring"].exposed_comm_s < rows["allgather"].exposed_comm_s
    assert not rows["ring"].notes  # no empty step
    assert "ulysses" in rows and not rows["ulysses"].feasible and "12 query heads" in rows["ulysses"].reason
    # heads that split over C: Ulysses sees every token of its heads, one exchange each way
    for window in ((128, 0), (-1, 0)):
        assert packed_choice(docs, window, 16, 16)[0] == "ulysses"
    # few K/V heads make the gather cheap: short documents, latency-bound, 32 query heads over C=8
    assert packed_choice([256] * 128, (-1, 0), 32, 32)[0] == "ulysses"
    assert packed_choice([256] * 128, (-1, 0), 32, 2)[0] == "allgather"  # Ulysses would replicate K/V x4
    # K/V heads that do not split are replicated, as ops.ulysses does
    assert any("replicated x4 (2 -> 8)" in n for n in packed_choice(docs, (-1, 0), 16, 2)[2]["ulysses"].notes)


def test_masked_ring_pays_transfers_of_empty_steps():
    """A ring step with no visible work costs its transfer and no compute; Ulysses and the gather do not care."""
    gpu = MACHINES["cuda"]
    busy = [[0.5, 0.5, 0.5, 0.5]] * 4
    empty_step = [[0.5 if j in (r, (r - 1) % 4) else 0.0 for j in range(4)] for r in range(4)]  # steps 2, 3 empty
    for tiles in (busy, empty_step):
        w = workload(c=4, s_local=4096, backward=False)
        w = replace(w, tiles=tuple(map(tuple, tiles)), visible=sum(map(sum, tiles)) / 16)
        ring = ESTIMATORS["ring"](w, gpu)
        step = w.tile_flops() / gpu.flops_for(w.dtype) * 0.5 + gpu.kernel_overhead
        transfer = gpu.transfer(w.kv_bytes(), 2)
        if tiles is busy:
            assert ring.compute_s == pytest.approx(4 * step) and ring.exposed_comm_s == pytest.approx(0.0)
        else:  # step i + 1's K/V travel during step i: step 3's find nothing to hide under (step 2 is empty)
            assert ring.compute_s == pytest.approx(2 * step)
            assert ring.exposed_comm_s == pytest.approx(transfer)
            assert ring.notes == [
                "2 of 4 ring steps have no visible work on any rank: nothing to hide the next transfer under"
            ]


def test_uniform_tiles_cost_like_the_sdpa_model():
    """Tiles spreading ``visible`` evenly reproduce the SDPA estimates (ring exactly; one kernel call less
    for the masked gather)."""
    w = workload(c=4, s_local=2048)
    uniform = replace(w, tiles=((w.visible,) * 4,) * 4)
    for m in MACHINES.values():
        assert ESTIMATORS["ring"](uniform, m).time_s == pytest.approx(ESTIMATORS["ring"](w, m).time_s)
        gap = ESTIMATORS["allgather"](w, m).time_s - ESTIMATORS["allgather"](uniform, m).time_s
        assert gap == pytest.approx(3.5 * m.kernel_overhead)
        assert ESTIMATORS["ulysses"](uniform, m).time_s == pytest.approx(ESTIMATORS["ulysses"](w, m).time_s)
    # the hybrid's ring runs between groups: tiles averaged over each group's ranks
    hybrid = ESTIMATORS["hybrid"](replace(uniform, mesh=(2, 2)), MACHINES["cuda"])
    assert hybrid.feasible and hybrid.time_s == pytest.approx(
        ESTIMATORS["hybrid"](replace(w, mesh=(2, 2)), MACHINES["cuda"]).time_s
    )


def test_packed_facts_come_from_cu_seqlens_or_say_they_do_not():
    """Eager calls are costed from their documents; a compiled site, whose documents are a run-time input,
    from what holds for every split (one document over the whole sequence), and the reason says so."""
    from cp_compile.cost import masked

    cu = [0, 100, 130, 256]
    local = cp_compile.layout.packed.packed_local_len(cu, 4)
    given = masked.packed_facts(torch.tensor(cu, dtype=torch.int32), local, 4, (8, 0))
    assert "over 3 documents (cu_seqlens)" in given.source and given.tiles == masked.packed_tiles(cu, 4, 8, 0)
    compiled = masked.packed_facts(None, 64, 4, (8, 0))
    assert "run-time input" in compiled.source and "one document of 256 tokens" in compiled.source
    assert compiled.tiles == masked.packed_tiles([0, 256], 4, 8, 0)


def capture_sites(fn, args, plan):
    """Stage 1 only, on the graph Dynamo captures: the rewritten sites (the compiled function returns zeros,
    so nothing runs on the fake process group)."""
    from cp_compile.compiler.rewrite import rewrite_attention

    sites = []

    def backend(gm, example_inputs):
        from cp_compile.torch_compat import size_hint

        outputs = [n.meta["example_value"] for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
        sites.extend(rewrite_attention(gm, plan, example_inputs))
        shapes = [[size_hint(d) for d in o.shape] for o in outputs]  # packed sizes are dynamic
        return lambda *a: tuple(torch.zeros(shape, dtype=o.dtype) for shape, o in zip(shapes, outputs))

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return sites


@pytest.mark.parametrize("fake_group", [4], indirect=True)
def test_explain_shows_masked_estimates(fake_group):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.attention.varlen import varlen_attn

    from cp_compile import masks
    from cp_compile.compiler.explain import site_report

    c, _ = fake_group
    plan = cp_compile.ContextParallel()
    cu = torch.tensor([0, 40, 41, 200, 256], dtype=torch.int32)
    q, k = torch.randn(256, 8, 16), torch.randn(256, 2, 16)
    local = [plan.shard(t, 0, cu_seqlens=cu) for t in (q, k, k)]

    gqa = varlen_gqa()

    def packed(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 159, 159, window_size=(16, 0), **gqa)

    (site,) = capture_sites(packed, [*local, cu], plan)
    text = str(site_report(site, c))
    assert f"over C={c} (auto:" in text
    assert "window (16, 0); the documents are a run-time input (one graph for every split)" in text
    assert "candidates (cpu (default)" in text
    for row in ("ring  ", "allgather", "ulysses", "hybrid    not possible"):
        assert row in text
    assert sum(line.lstrip().startswith("* ") for line in text.splitlines()) == 1

    seq = 256
    doc = torch.arange(seq) // 48
    block_mask = create_block_mask(
        masks.and_(masks.causal(), masks.document(doc)), None, None, seq, seq, device="cpu", BLOCK_SIZE=16
    )
    local_mask = plan.shard(block_mask)
    qs = [plan.shard(torch.randn(1, 4, seq, 16), 2) for _ in range(3)]
    (site,) = capture_sites(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm), [*qs, local_mask], plan)
    text = str(site_report(site, c))
    assert "global BlockMask's block counts (plan.shard)" in text and "candidates" in text
    assert "ulysses" in text and sum(line.lstrip().startswith("* ") for line in text.splitlines()) == 1

    # the mask a compiled call is given, read inside a checkpoint region too, whatever was sharded after it
    plan.shard(create_block_mask(masks.prefix_lm(seq // 2), None, None, seq, seq, device="cpu", BLOCK_SIZE=16))

    def checkpointed(q, k, v, bm):
        return torch.utils.checkpoint.checkpoint(flex_attention, q, k, v, block_mask=bm, use_reentrant=False)

    (again,) = capture_sites(checkpointed, [*qs, local_mask], plan)
    assert again.owner_path and again.decision.why == site.decision.why, (again.owner_path, again.decision.why)


@pytest.mark.parametrize("fake_group", [2], indirect=True)
def test_a_mask_reading_a_tensor_of_its_own_is_refused_at_compile_time(fake_group):
    """A BlockMask built for the local length whose mask_mod reads a LongTensor of its own: its first buffer is
    no CP index table (no C gives a table of that length), refused by name when compiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from cp_compile.errors import UnsupportedAttention

    plan, local = cp_compile.ContextParallel(), 64
    qs = [torch.randn(1, 2, local, 16) for _ in range(3)]
    # ``local`` entries, and as many as a table of one rank's shard without its tile counts
    for length in (local, 3 + local * 2):
        ids = torch.arange(length) // 16
        bm = create_block_mask(lambda b, h, q, k: ids[q] >= ids[k], None, None, local, local, device="cpu")
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="not a CP index table") as caught:
            capture_sites(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm), [*qs, bm], plan)
        assert isinstance(caught.value.inner_exception, UnsupportedAttention)
