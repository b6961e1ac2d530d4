"""Linear recurrences in modules of their own, by state passing: MiniMax's lightning attention (a linear attention
with a decay per head: ``cp_compile.mixers.lightning``) and RecurrentGemma's RG-LRU (a diagonal recurrence:
``mixers.diagonal``), put on the models' modules by ``hf.own_attention``.

The blockwise computation against the sum it stands for, in fp64; state passing on real gloo ranks, C = 1 to 4, under
zigzag, contiguous and packed documents (documents of length 1 and 0, chunks shorter than a block), forward, final
state and every gradient to 1e-12; the models' own classes trained compiled and generated from the states their
caches keep, against one process."""

import pytest
import torch
from test_mixers import _errors, _setup, _shard


def _summed(q, k, v, decay, state=None):
    """o_t = sum_{j <= t} exp(-s (t - j)) (q_t . k_j) v_j (+ exp(-s (t + 1)) q_t S): the definition, O(L^2)."""
    length = q.shape[2]
    t = torch.arange(length, dtype=q.dtype)
    behind = t[:, None] - t[None, :]
    s = decay.to(q.dtype)[:, None, None]
    weights = torch.where(behind >= 0, torch.exp(-s * behind.clamp(min=0)), 0.0)  # [H, L, L]
    out = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * weights, v)
    if state is not None:
        out = out + torch.matmul(q * torch.exp(-s * (t + 1)[:, None]), state)
    last = (k * torch.exp(-s * (length - 1 - t)[:, None])).transpose(-1, -2) @ v
    if state is not None:
        last = last + torch.exp(-decay.to(q.dtype) * length)[:, None, None] * state
    return out, last


@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_blocks_are_the_sum(block):
    from cp_compile.mixers.lightning import decayed_linear_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 23, 5, dtype=torch.float64, generator=g) for _ in range(3))
    state = torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=g)
    decay = torch.tensor([0.9, 0.05, 0.3])
    out, last = decayed_linear_attention(q, k, v, decay, block, state)
    want, want_last = _summed(q, k, v, decay, state)
    assert (out - want).abs().max() < 1e-12 * want.abs().max()
    assert (last - want_last).abs().max() < 1e-12 * want_last.abs().max()


def lightning_case(layout_name: str, with_state: bool, block: int, route: str = "states") -> list:
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.lightning import decayed_linear_attention, lightning

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(3)
    b, heads, d = 1, 3, 4
    f64 = dict(dtype=torch.float64)
    q, k, v = (torch.randn(b, total, heads, d, **f64, requires_grad=True) for _ in range(3))
    decay = torch.tensor([0.9, 0.05, 0.3])
    init = torch.randn(b, heads, d, d, **f64) if with_state else None
    ref, ref_state = decayed_linear_attention(*(t.transpose(1, 2) for t in (q, k, v)), decay, block, init)
    ref = ref.transpose(1, 2)
    dy, ds = torch.randn_like(ref), torch.randn_like(ref_state)
    ((ref * dy).sum() + (ref_state * ds).sum()).backward()
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in (q, k, v)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = lightning(*local, decay, block, sharding, route, init, final_state=True)
    # the final state is every rank's: its gradient is counted once, on rank 0
    ((out * _shard(plan, dy, 1, cu)).sum() + (state * ds).sum() * (plan.rank == 0)).backward()
    pairs = [(out.detach(), ref.detach(), 1)] + [(mine.grad, t.grad, 1) for mine, t in zip(local, (q, k, v))]
    errs = _errors(plan, pairs, cu) + [float((state - ref_state).abs().max())]
    scale = max(float(t.abs().max()) for t in (ref, ref_state, q.grad, k.grad, v.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("route", ["states", "heads"])
def test_both_routes_equal_one_process(ranks, world_size, route):
    """Three heads: at C = 2 and 4 the all-to-all pads them with zero heads."""
    for case in [("zigzag", False, 4), ("contiguous", True, 3), ("packed", False, 4), ("zigzag", True, 64)]:
        for errs in ranks(world_size, lightning_case, *case, route=route):
            assert max(errs) < 1e-12, (case, errs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_recurrences_generate_from_the_state_they_keep(ranks, world_size):
    """MiniMax: the sharded prefill leaves each lightning layer's cache the whole prompt's state (the chain's last,
    the same on every rank). RWKV: the prefill of all but the prompt's last token leaves its model's own ``state``
    list the whole prefix's (its WKV's numerator, denominator and maximum, the last token of each shift).
    Decoding runs the modules' own steps from them. Sampled with processors, prompts of 1 and 30 tokens, against one
    process with the same seed."""
    from test_hf_hybrids import generate_reading_the_sequence

    for family in ("minimax", "rwkv"):
        for results in ranks(world_size, generate_reading_the_sequence, family, [1, 30]):
            *runs, refusal = results
            for same, new, err in runs:
                assert same and new == 20 and err < 1e-5, (family, runs)
            assert "different tokens" in refusal, refusal


def _diagonal(x, a, state=None):
    """h_t = a_t * h_{t-1} + x_t, token by token: (h, the last state)."""
    h = torch.zeros_like(x[:, 0]) if state is None else state
    out = []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        out.append(h)
    return torch.stack(out, 1), h


def diagonal_case(layout_name: str, with_state: bool) -> list:
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.diagonal import diagonal_scan_states

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(4)
    f64 = dict(dtype=torch.float64)
    x = torch.randn(1, total, 6, **f64, requires_grad=True)
    a = torch.rand(1, total, 6, **f64)
    a[:, torch.arange(total) % 7 == 3] = 0.0  # resets (the RG-LRU's documents)
    a.requires_grad_()
    init = torch.randn(1, 6, **f64) if with_state else None
    ref, ref_state = _diagonal(x, a, init)
    dy, ds = torch.randn_like(ref), torch.randn_like(ref_state)
    ((ref * dy).sum() + (ref_state * ds).sum()).backward()
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in (x, a)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = diagonal_scan_states(_diagonal, *local, sharding, init)
    ((out * _shard(plan, dy, 1, cu)).sum() + (state * ds).sum() * (plan.rank == 0)).backward()
    pairs = [(out.detach(), ref.detach(), 1)] + [(mine.grad, t.grad, 1) for mine, t in zip(local, (x, a))]
    errs = _errors(plan, pairs, cu) + [float((state - ref_state).abs().max())]
    scale = max(float(t.abs().max()) for t in (ref, ref_state, x.grad, a.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_diagonal_recurrence_by_state_passing(ranks, world_size):
    """RecurrentGemma's RG-LRU recurrence: gates of zero where documents restart, an entering state, packed
    documents (their chunks' zero tokens in front decay nothing)."""
    for case in [("zigzag", False), ("contiguous", True), ("packed", False), ("packed", True)]:
        for errs in ranks(world_size, diagonal_case, *case):
            assert max(errs) < 1e-12, (case, errs)


@pytest.mark.parametrize("world_size", [2])
def test_recurrent_gemma_bf16_within_twice_one_process_error(ranks, world_size):
    """RecurrentGemma in bf16 (the state passing's summaries and fold in fp32): its gradients as close to fp64's as
    twice one process's (measured: 0.034 against 0.027). MiniMax has no fp64 one-process run to compare with: its
    expert layers take no fp64."""
    from test_own_attention import train_step

    for result in ranks(world_size, train_step, "recurrent_gemma", "bfloat16", "eager", 256):
        assert result["grads_vs_fp64"] <= 2 * result["one_process_vs_fp64"], result


def _wkv_loop(time_decay, time_first, key, value, state=None):
    """RWKV's WKV token by token, its state kept as (num, den, m) with the real numerator num * exp(m)."""
    w = -torch.exp(time_decay)
    if state is None:
        num, den = torch.zeros_like(key[:, 0]), torch.zeros_like(key[:, 0])
        m = torch.full_like(key[:, 0], -1e38)
    else:
        num, den, m = state
    out = []
    for t in range(key.shape[1]):
        k, v = key[:, t], value[:, t]
        top = torch.maximum(m, k + time_first)
        old, new = torch.exp(m - top), torch.exp(k + time_first - top)
        out.append((old * num + new * v) / (old * den + new))
        top = torch.maximum(m + w, k)
        old, new = torch.exp(m + w - top), torch.exp(k - top)
        num, den, m = old * num + new * v, old * den + new, top
    return torch.stack(out, 1), [num, den, m]


def _wkv_summed(time_decay, time_first, key, value, start):
    """The WKV by its definition, O(L^2): token t reads the state entering (N0, D0 decayed t times), every earlier
    token s decayed t-1-s times, and its own with the bonus ``time_first``; and the state after the last token."""
    length = key.shape[1]
    w = -torch.exp(time_decay)
    t = torch.arange(length, dtype=key.dtype)
    behind = (t[:, None] - 1 - t[None, :])[..., None]  # [L, L, 1]
    weights = torch.where(behind >= 0, torch.exp(w * behind.clamp(min=0) + key[:, None]), 0.0)  # [B, t, s, W]
    entering = torch.exp(w * t[:, None])  # [L, W]
    n0, d0 = start[..., 0] * start[..., 2].exp(), start[..., 1] * start[..., 2].exp()
    own = torch.exp(time_first + key)
    num = (weights * value[:, None]).sum(2) + entering * n0[:, None] + own * value
    den = weights.sum(2) + entering * d0[:, None] + own
    after = torch.exp(w * (length - 1 - t)[:, None] + key)
    last_n = (after * value).sum(1) + torch.exp(w * length) * n0
    last_d = after.sum(1) + torch.exp(w * length) * d0
    return num / den, torch.stack([last_n, last_d], -1)


def wkv_case(layout_name: str, with_state: bool) -> list:
    import torch.distributed as dist
    import torch.nn.functional as F

    from cp_compile.mixers import Sharding
    from cp_compile.mixers.wkv import token_shift, wkv_states

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(5)
    f64 = dict(dtype=torch.float64)
    key, value = (torch.randn(1, total, 6, **f64, requires_grad=True) for _ in range(2))
    decay, first = (torch.randn(6, **f64, requires_grad=True) for _ in range(2))
    start = torch.stack([torch.randn(1, 6, **f64), torch.rand(1, 6, **f64) + 0.5, torch.randn(1, 6, **f64)], -1)
    start = start if with_state else torch.zeros(1, 6, 3, **f64)
    ref, ref_state = _wkv_summed(decay, first, key, value, start)
    dy, ds = torch.randn_like(ref), torch.randn_like(ref_state)
    ((ref * dy).sum() + (ref_state * ds).sum()).backward()
    local = [_shard(plan, t.detach(), 1, cu).requires_grad_() for t in (key, value)]
    mine = [t.detach().clone().requires_grad_() for t in (decay, first)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = wkv_states(_wkv_loop, *mine, *local, sharding, start if with_state else None)
    real = torch.stack([state[..., 0] * state[..., 2].exp(), state[..., 1] * state[..., 2].exp()], -1)
    ((out * _shard(plan, dy, 1, cu)).sum() + (real * ds).sum() * (plan.rank == 0)).backward()
    for p in mine:  # each rank's share of the parameters' gradient
        dist.all_reduce(p.grad, group=plan.group)
    shifted = token_shift(local[0].detach(), sharding)
    want_shift = F.pad(key.detach(), (0, 0, 1, -1))
    pairs = [(out.detach(), ref.detach(), 1), (shifted, want_shift, 1)]
    pairs += [(m.grad, t.grad, 1) for m, t in zip(local, (key, value))]
    errs = _errors(plan, pairs, cu) + [float((real - ref_state).detach().abs().max())]
    errs += [float((m.grad - t.grad).abs().max()) for m, t in zip(mine, (decay, first))]
    scale = max(float(t.abs().max()) for t in (ref, ref_state, key.grad, value.grad, decay.grad, first.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rwkv_wkv_and_token_shift_by_state_passing(ranks, world_size):
    """RWKV's WKV (a numerator and denominator per channel, kept with their running maximum) by state passing, its
    token shift by a one-token halo: forward, final state and every gradient (the parameters' summed over the
    ranks) against the definition, with an entering state, packed documents run through as one process runs them."""
    for case in [("zigzag", False), ("contiguous", True), ("packed", False), ("packed", True)]:
        for errs in ranks(world_size, wkv_case, *case):
            assert max(errs) < 1e-12, (case, errs)


@pytest.mark.parametrize("world_size", [3, 4])  # C = 2: the model sweep (tests/test_models.py)
def test_recurrent_models_train_exactly(ranks, world_size):
    """RWKV's and xLSTM's models in fp64 against one process. RWKV's WKV reads its keys, and takes their gradient, in
    fp32 whatever the model's dtype, and xLSTM's kernels keep their states in fp32 (``inference_state_dtype``), so
    their gradients are as close as fp32's rounding at any C (a plan of one rank included); the recurrences
    themselves are checked in fp64 above."""
    from test_own_attention import train_step

    for family, rerouted in (("rwkv", 4), ("xlstm", 1)):
        for result in ranks(world_size, train_step, family):
            assert result["rerouted"] >= rerouted and max(result["loss"], result["grads"]) < 1e-6, (family, result)


def _mlstm_loop(q, k, v, i, f, c=None, n=None, m=None, eps=1e-6):
    """The mLSTM token by token (``[N, H, L, D]``, gates ``[N, H, L]``): (h, (C, n, m) after the last token)."""
    batch, heads, length, dk = k.shape
    c = k.new_zeros(batch, heads, dk, v.shape[-1]) if c is None else c
    n = k.new_zeros(batch, heads, dk) if n is None else n
    m = k.new_zeros(batch, heads, 1) if m is None else m
    out = []
    for t in range(length):
        log_f, gate = torch.nn.functional.logsigmoid(f[:, :, t, None]), i[:, :, t, None]
        top = torch.maximum(log_f + m, gate)
        kept, added = torch.exp(log_f + m - top), torch.exp(gate - top)
        c = kept[..., None] * c + added[..., None] * (k[:, :, t, :, None] @ v[:, :, t, None, :])
        n = kept * n + added * k[:, :, t]
        scaled = q[:, :, t] * dk**-0.5
        below = torch.maximum((scaled * n).sum(-1, keepdim=True).abs(), torch.exp(-top)) + eps
        out.append((scaled[:, :, None, :] @ c).squeeze(2) / below)
        m = top
    return torch.stack(out, 2), (c, n, m)


def mlstm_case(layout_name: str, with_state: bool) -> list:
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.mlstm import mlstm_states

    plan, cu, total = _setup(layout_name, seq_per_rank=5)
    torch.manual_seed(6)
    f64 = dict(dtype=torch.float64)
    q, k, v = (torch.randn(1, 2, total, d, **f64, requires_grad=True) for d in (4, 4, 3))
    i, f = (torch.randn(1, 2, total, **f64) * 3 for _ in range(2))
    i, f = i.requires_grad_(), f.requires_grad_()
    start = (
        (torch.randn(1, 2, 4, 3, **f64), torch.randn(1, 2, 4, **f64), torch.randn(1, 2, 1, **f64))
        if with_state
        else None
    )
    ref, ref_state = _mlstm_loop(q, k, v, i, f, *(start or ()))
    dy = torch.randn_like(ref)
    ds = [torch.randn_like(t) for t in ref_state]
    ((ref * dy).sum() + sum((s * d).sum() for s, d in zip(ref_state, ds))).backward()
    local = [_shard(plan, t.detach(), 2, cu).requires_grad_() for t in (q, k, v, i, f)]
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance, cu)
    out, state = mlstm_states(lambda *a: _mlstm_loop(*a), *local, sharding, start)
    final = sum((s * d).sum() for s, d in zip(state, ds))
    ((out * _shard(plan, dy, 2, cu)).sum() + final * (plan.rank == 0)).backward()
    pairs = [(out.detach(), ref.detach(), 2)] + [(mine.grad, t.grad, 2) for mine, t in zip(local, (q, k, v, i, f))]
    errs = _errors(plan, pairs, cu) + [float((s - r).detach().abs().max()) for s, r in zip(state, ref_state)]
    scale = max(float(t.abs().max()) for t in (ref, *ref_state, q.grad, k.grad, v.grad, i.grad, f.grad))
    return [e / scale for e in errs]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mlstm_by_state_passing(ranks, world_size):
    """xLSTM's mLSTM: its matrix memory, normalizer and running maximum (which its output reads, so the true one is
    passed) by state passing: forward, final state and every gradient against the cell token by token in fp64, with
    an entering state, packed documents run through as one process runs them."""
    for case in [("zigzag", False), ("contiguous", True), ("packed", False), ("packed", True)]:
        for errs in ranks(world_size, mlstm_case, *case):
            assert max(errs) < 1e-12, (case, errs)


def xlstm_generation() -> tuple:
    """xLSTM's greedy generation under the plan without a cache, against one process's; then with one: refused."""
    import cp_compile
    import cp_compile.hf
    from cp_compile.errors import UnsupportedAttention
    from cp_compile.tools.bench.model_configs import tiny_config
    from cp_compile.tools.bench.model_run import _build, _reference_model

    config, cls, _ = tiny_config("xlstm")
    model, reference = _build(cls, config, "cp_compile").eval(), _reference_model(cls, config)[0].eval()
    ids = torch.randint(2, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(ids, use_cache=False, **kwargs)
        with cp_compile.ContextParallel():
            got = cp_compile.hf.generate(model, ids, use_cache=False, **kwargs)
            try:
                cp_compile.hf.generate(model, ids, **kwargs)
            except UnsupportedAttention as e:
                refusal = str(e)
            else:
                refusal = "no error"
    return torch.equal(got, expected), refusal


def test_xlstm_generates_without_a_cache(ranks):
    """xLSTM keeps its state in a cache class of its own, which the sharded prefill does not fill: it generates with
    use_cache=False (each step over the whole sequence, sharded) as one process does, and a generation with a cache is
    refused by name on every rank (not an AttributeError from inside its model)."""
    for same, refusal in ranks(2, xlstm_generation):
        assert same and "a cache of its own class (xLSTMCache)" in refusal and "use_cache=False" in refusal, refusal
