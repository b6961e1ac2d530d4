"""FlexAttention under CP on real gloo ranks: eager op (forward + backward) and the ring's skipped work."""

import pytest
import torch

from helpers import make_qkv, max_err

CHUNK = 4  # tokens per zigzag chunk: S = 2 * C * CHUNK


def mask_case(name: str, seq: int):
    """(mask_mod, score_mod) over global indices for a named case, the same on every rank."""
    from cp_compile import masks

    if name == "document-causal":
        # documents of odd lengths: they straddle chunk and rank boundaries
        lengths, doc, i = [5, 3, 7, 1, 9], torch.empty(seq, dtype=torch.long), 0
        while i < seq:
            for d, n in enumerate(lengths * seq):
                doc[i:i + n] = d
                i += n
                if i >= seq:
                    break
        return masks.and_(masks.causal(), masks.document(doc)), None
    if name == "window-small":
        return masks.sliding_window(CHUNK - 1), None
    if name == "window-large":
        return masks.sliding_window(3 * CHUNK + 1), None
    if name == "prefix-lm":
        return masks.prefix_lm(seq // 3 + 1), None
    if name == "bias-score":
        bias = torch.randn(seq, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx] - 0.5 * bias[kv_idx] + 0.1 * (q_idx - kv_idx)

        return masks.causal(), score_mod
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
    s = s.masked_fill(~mask_mod(0, 0, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = p @ vv
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_flex_eager(case: str, schedule: str, hq: int = 2, hkv: int = 2, backward: bool = True):
    import cp_compile
    from torch.nn.attention.flex_attention import create_block_mask

    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * CHUNK
    mask_mod, score_mod = mask_case(case, seq)
    q, k, v, do = make_qkv(1, hq, hkv, seq, 8, seed=plan.world_size)
    scale = 0.3
    ref = reference(q, k, v, do, mask_mod, score_mod, scale)
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK)
    local_mask = plan.shard(block_mask)
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    with cp_compile.count_blocks() as blocks, cp_compile.count_traffic() as traffic:
        out, lse = cp_compile.flex_attention(*leaves, score_mod=score_mod, block_mask=local_mask, scale=scale,
                                             enable_gqa=hq != hkv, return_lse=True, schedule=schedule)
        if backward:
            out.backward(plan.shard(do, 2))
    got = [out.detach(), lse] + ([t.grad for t in leaves] if backward else [])
    want = [ref[0], ref[1]] + (list(ref[2:]) if backward else [])
    return {
        "err": [max_err(g, plan.shard(w, 2)) for g, w in zip(got, want)],
        "nan": any(torch.isnan(g).any().item() for g in got[:1] + got[2:]),
        "blocks": (blocks.computed, blocks.skipped),
        "shifts": dict(traffic.by_tag),
    }


CASES = ["document-causal", "window-small", "window-large", "prefix-lm", "bias-score"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES)
def test_eager_ring_fp64_forward_backward(ranks, world_size, case):
    for result in ranks(world_size, run_flex_eager, case, "ring"):
        assert not result["nan"]
        assert max(result["err"]) < 1e-10, result["err"]


def run_flex_compiled(inner: str, case: str, dtype_name: str = "float64", checkpoint: bool = False):
    """The compiled rewrite of torch's flex_attention (forward: CPU flex refuses grads under Dynamo)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.utils.checkpoint import checkpoint as ckpt

    import cp_compile

    torch._dynamo.reset()
    counters.clear()
    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel()
    seq = 2 * plan.world_size * CHUNK
    mask_mod, score_mod = mask_case(case, seq)
    q, k, v, do = make_qkv(1, 4, 2, seq, 8, seed=plan.world_size)
    ref = reference(q, k, v, do, mask_mod, score_mod, 0.3)
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK)
    single, single_lse = flex_attention(*(t.to(dtype) for t in (q, k, v)), score_mod=score_mod,
                                        block_mask=block_mask, scale=0.3, enable_gqa=True, return_lse=True)

    def attend(q, k, v, bm):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.3, enable_gqa=True,
                                  return_lse=True)
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
        "sites": [(s.kind, s.location, s.decision["schedule"]) for r in backend.records for s in r.sites],
        "listing": [x for r in backend.records for x in r.schedules],
    }


@pytest.mark.parametrize("world_size", [2])
def test_compiled_fp64_aot_eager(ranks, world_size):
    # fp64: Inductor's CPU flex lowering takes fp32/fp16/bf16 only, so aot_eager here
    for result in ranks(world_size, run_flex_compiled, "aot_eager", "document-causal", timeout=600):
        assert result["graph_breaks"] == 0
        assert result["sites"] and result["sites"][0][0] == "flex"
        assert max(result["err"]) < 1e-10, result
