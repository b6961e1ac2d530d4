"""Token mixers that are not attention (``cp_compile.mixers``) on real gloo ranks against the unsharded call.

The short causal convolution (halo exchange) and the linear recurrences (all-to-all to head groups
around transformers' own torch bodies of the gated delta rule and Mamba2's SSD), fp64, C = 1 to 4, under
zigzag, contiguous and packed documents (chunks shorter than the halo, documents of length 1 and 0,
lengths that are not a multiple of the scan's chunk), forward and every input's gradient.
"""

import pytest
import torch

LAYOUTS = {  # name: (layout, cu_seqlens or None, tokens per rank's chunk for the chunked layouts)
    "zigzag": ("zigzag", None),
    "contiguous": ("contiguous", None),
    "packed": ("zigzag", [0, 21, 22, 27, 27, 65, 73]),  # lengths 21, 1, 5, 0, 38, 8
}
SEQ_PER_RANK = 6  # zigzag: chunks of 3 tokens, shorter than a width-5 halo


def _setup(layout_name, seq_per_rank=SEQ_PER_RANK):
    import cp_compile

    layout, cu = LAYOUTS[layout_name]
    plan = cp_compile.ContextParallel(load_balance=layout)
    cu_t = None if cu is None else torch.tensor(cu)
    total = cu[-1] if cu is not None else seq_per_rank * 2 * plan.world_size
    return plan, cu_t, total


def _shard(plan, x, dim, cu):
    return plan.shard(x, dim, cu_seqlens=cu) if cu is not None else plan.shard(x, dim)


def _errors(plan, pairs, cu):
    """Largest error of each CP tensor (a shard) against the shard of its reference, and the reference's scale."""
    out = []
    for got, ref, dim in pairs:
        want = _shard(plan, ref, dim, cu)
        if cu is not None:  # padding slots hold no token: compare the real ones
            from cp_compile.layout.runs import real_slots

            real = real_slots("zigzag", want.shape[dim], plan.world_size, cu)[plan.rank].nonzero().flatten()
            got, want = got.index_select(dim, real), want.index_select(dim, real)
        out.append(float((got - want).abs().max()) if got.numel() else 0.0)
    return out


def conv_case(layout_name, width, reset):
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.conv import causal_conv1d, depthwise_causal_conv1d

    plan, cu, total = _setup(layout_name)
    torch.manual_seed(0)
    b, d = 2, 5
    x = torch.randn(b, d, total, dtype=torch.float64, requires_grad=True)
    w = torch.randn(d, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(d, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(b, d, total, dtype=torch.float64)
    if reset and cu is not None:  # one process, restarting at every document
        bounds = cu.tolist()
        ref = torch.cat(
            [depthwise_causal_conv1d(x[..., a:e], w, bias, "silu") for a, e in zip(bounds, bounds[1:]) if e > a], -1
        )
    else:
        ref = depthwise_causal_conv1d(x, w, bias, "silu")
    ref.backward(dy)
    xs = _shard(plan, x.detach(), 2, cu).requires_grad_()
    wl, bl = w.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    y = causal_conv1d(xs, wl, bl, "silu", sharding, reset=reset)
    y.backward(_shard(plan, dy, 2, cu))
    for p in (wl, bl):  # parameters: every rank's share of the gradient
        torch.distributed.all_reduce(p.grad)
    errs = _errors(plan, [(y.detach(), ref.detach(), 2), (xs.grad, x.grad, 2)], cu)
    errs += [float((wl.grad - w.grad).abs().max()), float((bl.grad - bias.grad).abs().max())]
    return errs


def sequence_tails(count: int, lengths: list) -> list:
    """A convolution's state after a sharded prefill (the sequence's last ``count`` tokens, zeros before its first)
    against the unsharded sequence's: every layout, one sequence of each length (the packed layout pads it to 2C
    chunks, some of them empty)."""
    import cp_compile
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.halo import sequence_tail

    wrong = []
    for layout in ("zigzag", "contiguous", "packed"):
        for n in lengths:
            plan = cp_compile.ContextParallel(load_balance="contiguous" if layout == "contiguous" else "zigzag")
            cu = torch.tensor([0, n]) if layout == "packed" else None
            if cu is None and n % (2 * plan.world_size):
                continue  # one sequence per row splits evenly or is refused by the plan
            x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(n))
            want = torch.nn.functional.pad(x, (max(count - n, 0), 0))[..., -count:]
            sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
            got = sequence_tail(_shard(plan, x, 2, cu), 2, count, sharding)
            if not torch.equal(got, want):
                wrong.append((layout, n, got[0, 0].tolist(), want[0, 0].tolist()))
    return wrong


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sequence_tail_is_the_prompts_last_tokens(ranks, world_size):
    for wrong in ranks(world_size, sequence_tails, 4, [*range(1, 14), 23, 24, 25]):
        assert not wrong, wrong


def _own_mixer(x, w):
    """A mixer of its own: a recurrence with a learned decay per channel, plus a read of the whole sequence."""
    decay, state, out = torch.sigmoid(w), torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        state = decay * state + x[:, t]
        out.append(state)
    return torch.stack(out, 1) + x.mean(1, keepdim=True)


def gathered_case(layout_name):
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.gathered import gather_sequence, rank_rows

    plan, cu, total = _setup(layout_name)
    torch.manual_seed(0)
    x = torch.randn(2, total, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, total, 5, dtype=torch.float64)
    ref = _own_mixer(x, w)
    ref.backward(dy)
    xs = _shard(plan, x.detach(), 1, cu).requires_grad_()
    wl = w.detach().clone().requires_grad_()
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    y = rank_rows(_own_mixer(gather_sequence(xs, 1, sharding), wl), 1, xs.shape[1], sharding)
    y.backward(_shard(plan, dy, 1, cu))
    torch.distributed.all_reduce(wl.grad)
    errs = _errors(plan, [(y.detach(), ref.detach(), 1), (xs.grad, x.grad, 1)], cu)
    return errs + [float((wl.grad - w.grad).abs().max())]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_mixer_of_its_own_over_the_gathered_sequence(ranks, world_size):
    """The gathered route: output, input and parameter gradients in fp64, every layout (packed: padding dropped,
    documents of length 1 and 0)."""
    for layout in LAYOUTS:
        for errs in ranks(world_size, gathered_case, layout):
            assert max(errs) < 1e-10, (layout, errs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_conv_halo_fp64_equals_one_process(ranks, world_size):
    cases = [(layout, width, False) for layout in LAYOUTS for width in (2, 4, 7)] + [("packed", 4, True)]
    for case in cases:
        for errs in ranks(world_size, conv_case, *case):
            assert max(errs) < 1e-12, (case, errs)


def gdn_case(layout_name, hk, hv, with_state, route="heads"):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from cp_compile.mixers import Sharding
    from cp_compile.mixers.scan import gated_delta_rule

    scan = torch_chunk_gated_delta_rule
    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(1)
    b, dk, dv = 1, 4, 3
    f64 = dict(dtype=torch.float64)
    q, k = (torch.randn(b, total, hk, dk, **f64, requires_grad=True) for _ in range(2))
    v = torch.randn(b, total, hv, dv, **f64, requires_grad=True)
    g = (-torch.rand(b, total, hv, **f64)).requires_grad_()
    beta = torch.rand(b, total, hv, **f64).requires_grad_()
    init = torch.randn(b, hv, dk, dv, **f64) if with_state else None
    leaves = [q, k, v, g, beta]
    kw = dict(chunk_size=4, use_qk_l2norm_in_kernel=True, initial_state=init, output_final_state=True)
    ref, ref_state = scan(*leaves, **kw)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in leaves]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = gated_delta_rule(scan, *local, sharding, route=route, **kw)
    out.backward(_shard(plan, dy, 1, cu))
    pairs = [(out.detach(), ref.detach(), 1)] + [(mine.grad, t.grad, 1) for mine, t in zip(local, leaves)]
    errs = _errors(plan, pairs, cu)
    if cu is None:  # packed: the padding slots after the last document follow the real tokens
        errs.append(float((state - ref_state).abs().max()))
    return errs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gated_delta_rule_fp64_equals_one_process(ranks, world_size):
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    for case in [("zigzag", 2, 4, False), ("contiguous", 3, 3, True), ("packed", 1, 2, False), ("zigzag", 5, 5, True)]:
        for errs in ranks(world_size, gdn_case, *case):
            assert max(errs) < 1e-10, (case, errs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gated_delta_rule_by_state_passing(ranks, world_size):
    """The same calls by state passing: every chunk scanned from zero in transformers' body, which computes in
    fp32 whatever the input, then corrected: fp32 rounding against the one-process call."""
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    for case in [("zigzag", 2, 4, False), ("contiguous", 3, 3, True), ("zigzag", 5, 5, True), ("packed", 1, 2, False)]:
        for errs in ranks(world_size, gdn_case, *case, route="states"):
            assert max(errs) < 1e-5, (case, errs)


def recurrent_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """The gated delta rule token by token in the input's dtype (fp64 here), with transformers' conventions
    (q, k l2-normalised, q scaled by d_k^-0.5, state [d_k, d_v], S_t = e^g (I - b k k^T) S + b k v^T)."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    q, k = (torch.nn.functional.normalize(t, dim=-1).repeat_interleave(hv // hk, 2) for t in (q, k))
    q = q * dk**-0.5
    state = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for t in range(n):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None]
        state = state * g[:, t].exp()[..., None, None]
        delta = (vt - torch.einsum("bhk,bhkv->bhv", kt, state)) * bt
        state = state + torch.einsum("bhk,bhv->bhkv", kt, delta)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, 1), (state if output_final_state else None)


def gdn_fp64_case(layout_name, route):
    """State passing's algebra in fp64: a scan that computes in fp64 gives the one-process result to ~1e-13."""
    import cp_compile.mixers.scan as scan_module
    from cp_compile.mixers import Sharding

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(6)
    f64 = dict(dtype=torch.float64)
    q, k = (torch.randn(1, total, 2, 4, **f64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, total, 4, 3, **f64, requires_grad=True)
    g = (-torch.rand(1, total, 4, **f64)).requires_grad_()
    beta = torch.rand(1, total, 4, **f64).requires_grad_()
    leaves = [q, k, v, g, beta]
    ref, ref_state = recurrent_delta_rule(*leaves, output_final_state=True)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in leaves]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = scan_module.gated_delta_rule(
        recurrent_delta_rule, *local, sharding, route=route, output_final_state=True
    )
    out.backward(_shard(plan, dy, 1, cu))
    pairs = [(out.detach(), ref.detach(), 1)] + [(m.grad, t.grad, 1) for m, t in zip(local, leaves)]
    return _errors(plan, pairs, cu) + [float((state.double() - ref_state).abs().max())]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gated_delta_rule_fp64_with_an_fp64_scan(ranks, world_size):
    """Both routes with a scan that keeps fp64 (transformers' bodies compute in fp32): exact to fp64 rounding,
    so what the routes differ by on transformers' bodies is fp32 rounding, not algebra."""
    for route, layout in (("heads", "zigzag"), ("states", "zigzag"), ("states", "packed")):
        for errs in ranks(world_size, gdn_fp64_case, layout, route):
            assert max(errs) < 1e-10, (route, layout, errs)


def mamba2_case(layout_name, heads, groups, with_state, route="heads"):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from cp_compile.mixers import Sharding
    from cp_compile.mixers.scan import mamba2_scan

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(2)
    b, p, n = 1, 3, 4
    f64 = dict(dtype=torch.float64)
    x = torch.randn(b, total, heads, p, **f64, requires_grad=True)
    dt = torch.randn(b, total, heads, **f64, requires_grad=True)
    bm, cm = (torch.randn(b, total, groups, n, **f64, requires_grad=True) for _ in range(2))
    a = (-torch.rand(heads, **f64)).requires_grad_()
    d = torch.randn(heads, **f64, requires_grad=True)
    dt_bias = torch.randn(heads, **f64, requires_grad=True)
    init = torch.randn(b, heads, p, n, **f64) if with_state else None
    kw = dict(dt_softplus=True, dt_limit=(0.05, 5.0), initial_states=init, return_final_states=True)
    ref, ref_state = mamba2_chunk_scan(x, dt, a, bm, cm, 4, D=d, dt_bias=dt_bias, **kw)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in (x, dt, bm, cm)]
    params = [t.detach().clone().requires_grad_() for t in (a, d, dt_bias)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = mamba2_scan(
        mamba2_chunk_scan,
        *local[:2],
        params[0],
        *local[2:],
        4,
        sharding,
        D=params[1],
        dt_bias=params[2],
        route=route,
        **kw,
    )
    out.backward(_shard(plan, dy, 1, cu))
    for t in params:
        torch.distributed.all_reduce(t.grad)
    pairs = [(out.detach(), ref.detach(), 1)] + [(mine.grad, t.grad, 1) for mine, t in zip(local, (x, dt, bm, cm))]
    errs = _errors(plan, pairs, cu)
    errs += [float((mine.grad - t.grad).abs().max()) for mine, t in zip(params, (a, d, dt_bias))]
    if cu is None:
        errs.append(float((state - ref_state).abs().max()))
    scale = max(float(t.abs().max()) for t in (ref, x.grad, dt.grad, bm.grad, cm.grad, a.grad, d.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mamba2_scan_equals_one_process(ranks, world_size):
    """Exact where C divides the B/C groups; else each head gets its own copy of its group's B and C, whose
    gradients are summed outside transformers' body, which computes in fp32 whatever the input: fp32 rounding."""
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    for case in [("zigzag", 4, 2, False), ("contiguous", 6, 3, True), ("packed", 4, 1, False), ("zigzag", 5, 1, True)]:
        tol = 1e-12 if case[2] % world_size == 0 else 1e-6
        for errs in ranks(world_size, mamba2_case, *case):
            assert max(errs) < tol, (case, errs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mamba2_scan_by_state_passing(ranks, world_size):
    """State passing in closed form: fp32 rounding (transformers' body computes in fp32) against one process."""
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    for case in [("zigzag", 4, 2, False), ("contiguous", 6, 3, True), ("zigzag", 5, 1, True), ("packed", 4, 1, False)]:
        for errs in ranks(world_size, mamba2_case, *case, route="states"):
            assert max(errs) < 1e-6, (case, errs)


def selective_case(layout_name, channels, with_state):
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    from cp_compile.mixers import Sharding
    from cp_compile.mixers.scan import selective_scan

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(5)
    b, n = 1, 3
    f64 = dict(dtype=torch.float64)
    x, dt, z = (torch.randn(b, channels, total, **f64, requires_grad=True) for _ in range(3))
    bm, cm = (torch.randn(b, n, total, **f64, requires_grad=True) for _ in range(2))
    a = (-torch.rand(channels, n, **f64)).requires_grad_()
    d, bias = (torch.randn(channels, **f64, requires_grad=True) for _ in range(2))
    kw = dict(delta_softplus=True, return_last_state=with_state)
    ref = mamba_selective_scan(x, dt, a, bm, cm, D=d, z=z, delta_bias=bias, **kw)
    ref, ref_state = ref if with_state else (ref, None)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    local = [_shard(plan, t.detach(), 2, cu).requires_grad_() for t in (x, dt, bm, cm, z)]
    params = [t.detach().clone().requires_grad_() for t in (a, d, bias)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out = selective_scan(
        mamba_selective_scan, *local[:2], params[0], *local[2:4], sharding, D=params[1], z=local[4],
        delta_bias=params[2], **kw,
    )  # fmt: skip
    out, state = out if with_state else (out, None)
    out.backward(_shard(plan, dy, 2, cu))
    for t in params:
        torch.distributed.all_reduce(t.grad)
    pairs = [(out.detach(), ref.detach(), 2)] + [(m.grad, t.grad, 2) for m, t in zip(local, (x, dt, bm, cm, z))]
    errs = _errors(plan, pairs, cu) + [float((m.grad - t.grad).abs().max()) for m, t in zip(params, (a, d, bias))]
    if with_state:
        errs.append(float((state - ref_state).abs().max()))
    scale = max(float(t.abs().max()) for t in (ref, x.grad, dt.grad, bm.grad, a.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_selective_scan_equals_one_process(ranks, world_size):
    """Mamba1's selective scan by an all-to-all to channels: transformers' body computes in fp32 whatever the
    input, so fp32 rounding against the one-process call; 7 channels split unevenly."""
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    for case in [("zigzag", 8, False), ("contiguous", 7, True), ("packed", 4, True)]:
        for errs in ranks(world_size, selective_case, *case):
            assert max(errs) < 1e-6, (case, errs)


def restarting_case(kind: str, route: str = "heads"):
    """Scans restarting at each packed document, as fla's kernels given ``cu_seqlens`` and mamba_ssm's given
    ``seq_idx`` do, against one process running each document alone: the gated delta rule token by token in
    fp64, Mamba2 by transformers' body (fp32 inside)."""
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.scan import gated_delta_rule, mamba2_scan

    plan, cu, total = _setup("packed")
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    lengths = cu.diff().tolist()
    torch.manual_seed(3)
    f64 = dict(dtype=torch.float64)
    if kind == "gdn":
        q, k = (torch.randn(1, total, 2, 4, **f64, requires_grad=True) for _ in range(2))
        v = torch.randn(1, total, 4, 3, **f64, requires_grad=True)
        g = (-torch.rand(1, total, 4, **f64)).requires_grad_()
        beta = torch.rand(1, total, 4, **f64).requires_grad_()
        leaves, shared = [q, k, v, g, beta], []

        def one_process(*tokens):
            return recurrent_delta_rule(*tokens)[0]

        def under_cp(local):
            return gated_delta_rule(recurrent_delta_rule, *local, sharding, cu_seqlens=cu, route=route)[0]
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

        x = torch.randn(1, total, 4, 3, **f64, requires_grad=True)
        dt = torch.randn(1, total, 4, **f64, requires_grad=True)
        bm, cm = (torch.randn(1, total, 2, 4, **f64, requires_grad=True) for _ in range(2))
        a = (-torch.rand(4, **f64)).requires_grad_()
        leaves, shared = [x, dt, bm, cm], [a]
        kw = dict(dt_softplus=True)

        def one_process(x, dt, bm, cm):
            return mamba2_chunk_scan(x, dt, a, bm, cm, 4, **kw)

        def under_cp(local):
            seq_idx = torch.zeros(1, local[0].shape[1], dtype=torch.int32)  # what marks it: the documents are cu
            return mamba2_scan(
                mamba2_chunk_scan, *local[:2], a, *local[2:], 4, sharding, seq_idx=seq_idx, route=route, **kw
            )

    documents = [pieces for pieces in zip(*(t.split(lengths, 1) for t in leaves)) if pieces[0].shape[1]]
    ref = torch.cat([one_process(*pieces) for pieces in documents], 1)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    expected = [t.grad.clone() for t in shared]
    for t in shared:
        t.grad = None
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in leaves]
    out = under_cp(local)
    out.backward(_shard(plan, dy, 1, cu))
    for t in shared:
        torch.distributed.all_reduce(t.grad)
    pairs = [(out.detach(), ref.detach(), 1)] + [(mine.grad, t.grad, 1) for mine, t in zip(local, leaves)]
    errs = _errors(plan, pairs, cu) + [float((t.grad - e).abs().max()) for t, e in zip(shared, expected)]
    scale = max(float(t.abs().max()) for t in [ref] + [t.grad for t in leaves] + expected)
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_scans_restarting_at_documents(ranks, world_size):
    """Documents of 21, 1, 5, 0, 38 and 8 tokens, each scanned from a zero state: the gated delta rule exact in
    fp64; Mamba2 within fp32 rounding (transformers' body computes in fp32, over each document padded to the
    longest here, alone there)."""
    pytest.importorskip("transformers", reason="Mamba2's scan is transformers' torch body")
    # state passing: each document's chain from a zero state; Mamba2's A then gathers its gradient from every
    # chunk's fp32 correction as well
    for kind, route, tol in (("gdn", "heads", 1e-12), ("gdn", "states", 1e-12), ("mamba2", "heads", 1e-6)):
        for errs in ranks(world_size, restarting_case, kind, route):
            assert max(errs) < tol, (kind, route, errs)
    for errs in ranks(world_size, restarting_case, "mamba2", "states"):
        assert max(errs) < 1e-5, ("mamba2", "states", errs)


def opcheck_mixer_ops():
    """Every mixer op passes torch.library.opcheck (schema, fake, autograd registration, AOT dispatch)."""
    import cp_compile

    plan = cp_compile.ContextParallel()
    torch.manual_seed(3)
    cu = torch.tensor([0, 3, 4, 11])
    x = torch.randn(2, 5, 2 * 2 * plan.world_size, dtype=torch.float64, requires_grad=True)
    packed = torch.randn(2, 5, 8 if plan.world_size == 2 else 11, dtype=torch.float64, requires_grad=True)
    groups = torch.randn(1, 4, 2 * plan.world_size, 3, dtype=torch.float64, requires_grad=True)
    cases = [
        (torch.ops.cp.halo, (x, 2, 4, plan.group_name, "zigzag", None, False)),
        (torch.ops.cp.halo, (packed, 2, 3, plan.group_name, "zigzag", cu, True)),
        (torch.ops.cp.halo_rows, (cu, packed.shape[2], plan.world_size, 3)),
        (torch.ops.cp.to_head_groups, (groups, plan.group_name, "contiguous", None)),
        (torch.ops.cp.rank_slice, (groups[0], plan.group_name)),
        (torch.ops.cp.gather_groups, (groups, plan.group_name)),
        (torch.ops.cp.gather_sequence, (groups, plan.group_name, "zigzag", None)),
        (torch.ops.cp.gather_sequence, (packed.transpose(1, 2), plan.group_name, "zigzag", cu)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    moved = torch.ops.cp.to_head_groups(groups, plan.group_name, "zigzag", None).detach().requires_grad_()
    torch.library.opcheck(torch.ops.cp.from_head_groups, (moved, plan.group_name, "zigzag", None))
    return True


def test_opcheck_mixer_ops(ranks):
    assert ranks(2, opcheck_mixer_ops) == [True, True]


def compiled_conv_and_scan(backend):
    """The mixer functions inside torch.compile(fullgraph=True): no graph break, the same values as eagerly."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    import cp_compile
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.conv import causal_conv1d
    from cp_compile.mixers.scan import gated_delta_rule

    torch._dynamo.reset()
    plan = cp_compile.ContextParallel()
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance)
    torch.manual_seed(4)
    total = 8 * plan.world_size
    x = torch.randn(1, total, 12)
    w = torch.randn(12, 4)

    def mixer(x_local, w):
        h = causal_conv1d(x_local.transpose(1, 2), w, None, "silu", sharding).transpose(1, 2)
        q, k, v = h.reshape(1, -1, 3, 2, 2).unbind(2)
        g = -torch.sigmoid(h[..., :2])
        beta = torch.sigmoid(h[..., 2:4])
        out, _ = gated_delta_rule(torch_chunk_gated_delta_rule, q, k, v, g, beta, sharding, chunk_size=4)
        return out

    local = plan.shard(x, 1)
    eager_leaves = [local.clone().requires_grad_(), w.clone().requires_grad_()]
    compiled_leaves = [local.clone().requires_grad_(), w.clone().requires_grad_()]
    want = mixer(*eager_leaves)
    want.sum().backward()
    got = torch.compile(mixer, backend=backend, fullgraph=True)(*compiled_leaves)
    got.sum().backward()
    pairs = [(got, want)] + [(c.grad, e.grad) for c, e in zip(compiled_leaves, eager_leaves)]
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_mixers_compile_whole(ranks, backend):
    pytest.importorskip("transformers", reason="the scan is transformers' torch body")
    from cp_compile.torch_compat import release

    if backend == "inductor" and release() < (2, 13):
        pytest.skip("torch 2.11's Inductor writes C++ for this graph that g++ rejects (decltype of a float)")
    for err in ranks(2, compiled_conv_and_scan, backend):
        assert err < 1e-5, err


def test_cost_model_routes():
    """The all-to-all's bytes grow with the length, state passing's do not (they grow with the chunks: two per
    packed document); the pick is the cheaper estimate."""
    from cp_compile.cost.mixers import ScanShape, choose_route, estimate_routes
    from cp_compile.cost.model import default_machine

    def shape(n, chunks=2):
        return ScanShape.delta_rule(1, n, 4, chunks, 16, 128, 32, 128, 32, 2)

    for device in ("cpu", "cuda"):
        machine = default_machine(device)
        short, long = (dict((e.route, e) for e in estimate_routes(shape(n), machine)) for n in (1024, 65536))
        assert long["heads"].bytes_moved == 64 * short["heads"].bytes_moved
        assert long["states"].bytes_moved == short["states"].bytes_moved
        best, estimates = choose_route(shape(65536), machine)
        assert best.time_s == min(e.time_s for e in estimates if e.feasible)
        assert not dict((e.route, e) for e in estimate_routes(shape(16), machine))["states"].feasible
        documents = dict((e.route, e) for e in estimate_routes(shape(65536, chunks=16), machine))
        assert documents["states"].bytes_moved == 8 * long["states"].bytes_moved
    assert choose_route(shape(65536), default_machine("cuda"))[0].route == "states"


def test_mixers_command(capsys):
    """``python -m cp_compile mixers`` on a short sequence: every route's row, against one process."""
    from cp_compile.__main__ import main

    assert main(["mixers", "--lengths", "128", "--world-sizes", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("conv halo", "GDN heads", "GDN states", "GDN gathered", "Mamba2 heads", "Mamba2 states"):
        assert f"\n{row}" in out, out
