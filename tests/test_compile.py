"""torch.compile with the CP backend on real gloo ranks: a single-device model, sharded inputs."""

import pytest
import torch

SEQ = 24  # global tokens; splits into 2C chunks for C = 2 and 3


def model_parity(inner: str, checkpoint: str, dtype_name: str = "float64", seq: int = SEQ, caches: bool = False):
    """Compiled CP model vs the same model on one device: loss, logits, summed gradients.

    Inductor's caches are off unless ``caches``: another case may already have cached an
    identical forward graph (full and selective checkpointing can partition alike), and a
    cache hit skips the passes and their records."""
    import torch._inductor.config
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import cp_compile
    from cp_compile.tools.llama import Llama, LlamaConfig, token_loss_sum

    torch._dynamo.reset()
    counters.clear()
    dtype = getattr(torch, dtype_name)
    plan = cp_compile.ContextParallel(schedule="ring")  # the ring's graphs and traffic are what is checked
    torch.manual_seed(0)
    cfg = LlamaConfig(checkpoint=checkpoint)
    model = Llama(cfg).to(dtype)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (2, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab, (2, seq), generator=gen)

    ref_logits = model(tokens, torch.arange(seq))
    ref_loss = token_loss_sum(ref_logits, labels)
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    backend = plan.backend(inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=not caches):
        logits = compiled(plan.shard(tokens, 1), plan.positions(seq))
        loss = token_loss_sum(logits, plan.shard(labels, 1))
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grad_err = 0.0
    for name, p in model.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed)
        grad_err = max(grad_err, (summed - ref_grads[name]).abs().max().item())
    return {
        "loss_err": abs(total.item() - ref_loss.item()),
        "logits_err": (logits - plan.shard(ref_logits, 1)).abs().max().item(),
        "grad_err": grad_err,
        "graph_breaks": sum(counters["graph_break"].values()),
        "sites": sum(len(r.sites) for r in backend.records),
        "expansions": sorted(e.direction for r in backend.records for e in r.expansions),
    }


CASES = [
    ("aot_eager", 2, "none"),
    ("aot_eager", 3, "none"),
    ("aot_eager", 2, "full"),
    ("aot_eager", 3, "selective"),
    # Inductor without checkpointing: test_depyf_dump_shows_the_expanded_ring (the same compile, dumped); at three
    # ranks: test_hf_families.test_inductor_and_three_ranks
    ("inductor", 2, "selective"),  # full checkpointing: aot_eager above (the same recompute, another lowering)
]


def _check_parity(result: dict) -> None:
    assert result["graph_breaks"] == 0
    assert result["sites"] == 2  # both layers' attention, also inside checkpoint bodies
    assert result["expansions"] == ["backward"] * 2 + ["forward"] * 2  # no ring re-run in backward
    assert result["loss_err"] < 1e-8 * 100  # a sum over 48 tokens of ~5.5 each
    assert result["logits_err"] < 1e-8
    assert result["grad_err"] < 1e-8


@pytest.mark.parametrize("inner,world_size,checkpoint", CASES)
def test_model_matches_single_device_fp64(ranks, inner, world_size, checkpoint):
    for result in ranks(world_size, model_parity, inner, checkpoint, timeout=600):
        _check_parity(result)


def generated_code(cache_dir: str):
    """Compile with a cache directory shared by all ranks; run cold, then warm from disk."""
    import os

    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.codecache import PyCodeCache

    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    runs = []
    try:
        with inductor_config.patch(fx_graph_cache=True):
            for _ in range(2):
                PyCodeCache.cache_clear(purge=False)
                counters.clear()
                result = model_parity("inductor", "none", caches=True)
                sources = sorted(open(m.__file__).read() for m in PyCodeCache.modules)
                runs.append({"result": result, "sources": sources, "hits": counters["inductor"]["fxgraph_cache_hit"]})
    finally:
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    return runs


def test_same_generated_code_on_every_rank_with_warm_shared_cache(ranks, tmp_path):
    per_rank = ranks(2, generated_code, str(tmp_path / "shared_cache"), timeout=600)
    for runs in per_rank:
        cold, warm = runs
        assert warm["hits"] >= 2  # forward and backward graphs came from the shared cache
        for run in runs:
            assert run["result"]["grad_err"] < 1e-8 and run["result"]["logits_err"] < 1e-8
    rank0, rank1 = per_rank
    assert rank0[0]["sources"] == rank1[0]["sources"]
    assert rank0[1]["sources"] == rank1[1]["sources"]
    forward = [c for c in rank0[0]["sources"] if "torch.ops.cp.attend.default(" in c]
    assert len(forward) == 1
    code = forward[0]
    # the expanded ring is in the generated forward: step 1's K/V go out before step 0 computes
    shift = code.index("torch.ops.cp.ring_shift.default(")
    step0 = code.index("torch.ops.cp.attend.default(")
    wait = code.index("torch.ops._c10d_functional.wait_tensor.default(")
    assert shift < step0 < wait
    assert any("torch.ops.cp.attend_backward.default(" in c for c in rank0[0]["sources"])


def compile_error(case: str):
    import torch.nn.functional as F

    import cp_compile

    plan = cp_compile.ContextParallel(schedule="ring")  # the ring's graphs and traffic are what is checked
    q = torch.randn(1, 2, 8, 16)

    def with_mask(q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))

    def with_dropout(q):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)

    fn = {"attn_mask": with_mask, "dropout_p": with_dropout}[case]
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=plan.backend("aot_eager"), fullgraph=True)(q)
    except Exception as e:  # noqa: BLE001
        # Dynamo reports backend errors as BackendCompilerFailed, keeping ours inside
        cause = e
        while cause is not None and not isinstance(cause, cp_compile.UnsupportedAttention):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__
        return (type(cause).__name__, str(cause)) if cause is not None else (type(e).__name__, str(e))
    return None


@pytest.mark.parametrize("argument", ["attn_mask", "dropout_p"])
def test_unsupported_arguments_fail_at_compile_time(ranks, argument):
    for kind, message in ranks(2, compile_error, argument, timeout=120):
        assert kind == "UnsupportedAttention"
        assert argument in message and "not supported" in message


def depyf_dump(out_dir: str):
    import os

    import depyf
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    rank_dir = os.path.join(out_dir, f"rank{torch.distributed.get_rank()}")
    # compile for real (no cache hits), so the post-grad graphs are produced and dumped
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        with depyf.prepare_debug(rank_dir):
            result = model_parity("inductor", "none")
    dumps = {}
    for name in os.listdir(rank_dir):
        if name.endswith(".py"):
            with open(os.path.join(rank_dir, name), errors="replace") as f:
                dumps[name] = f.read()
    return result, dumps


def test_depyf_dump_shows_the_expanded_ring(ranks, tmp_path):
    """Compiled by Inductor, fp64, without checkpointing: one process's loss, logits and gradients, and the dumped
    graphs show both stages of the rewrite."""
    for result, dumps in ranks(2, depyf_dump, str(tmp_path), timeout=600):
        _check_parity(result)
        joint = "".join(text for name, text in dumps.items() if "Joint_graph" in name)
        assert "cp.ring_attention" in joint  # stage 1: one CP op per site in the joint graph
        post_grad = [text for name, text in dumps.items() if "AFTER_POST_GRAD" in name]
        assert len(post_grad) == 2  # forward and backward
        for text in post_grad:  # stage 2: the ring, step by step
            assert "cp.ring_shift" in text and "wait_tensor" in text and "cp.attend" in text


def function_parity(inner: str):
    """Two SDPA calls with other arguments (non-causal + explicit scale; causal GQA), compiled."""
    import torch.nn.functional as F
    from helpers import make_qkv, max_err

    import cp_compile

    plan = cp_compile.ContextParallel(schedule="ring")  # the ring's graphs and traffic are what is checked
    q, k, v, do = make_qkv(2, 6, 2, 12 * plan.world_size, 10)

    def attention(q, k, v):
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.3)
        b = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return a * b

    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*ref_inputs).backward(do)
    torch._dynamo.reset()
    local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    out = torch.compile(attention, backend=plan.backend(inner), fullgraph=True)(*local)
    out.backward(plan.shard(do, 2))
    errs = [max_err(out, plan.shard(attention(q, k, v), 2))]
    errs += [max_err(a.grad, plan.shard(b.grad, 2)) for a, b in zip(local, ref_inputs)]
    return errs


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_noncausal_scale_and_gqa_compiled(ranks, inner):
    for errs in ranks(3, function_parity, inner, timeout=600):
        assert max(errs) < 1e-10, errs


def eager_call_compiled():
    """``cp_compile.ring_attention`` with the default group (``group=None``) called inside ``torch.compile``: the
    whole op lands in the graph as the model called it; forward and gradients against one device."""
    import torch.nn.functional as F
    from helpers import make_qkv, max_err

    import cp_compile

    plan = cp_compile.ContextParallel()
    q, k, v, do = make_qkv(1, 4, 2, 8 * plan.world_size, 8)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).backward(do)
    torch._dynamo.reset()
    local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]

    def attention(q, k, v):
        return cp_compile.ring_attention(q, k, v, is_causal=True, enable_gqa=True)

    out = torch.compile(attention, backend=plan.backend("aot_eager"), fullgraph=True)(*local)
    out.backward(plan.shard(do, 2))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return [max_err(out, plan.shard(want, 2))] + [max_err(a.grad, plan.shard(b.grad, 2)) for a, b in zip(local, ref)]


def test_eager_function_with_default_group_inside_compile(ranks):
    for errs in ranks(2, eager_call_compiled, timeout=300):
        assert max(errs) < 1e-10, errs


def attention_with_cache(cache_dir: str, local_len: int):
    """Causal SDPA fwd+bwd compiled with Inductor and a given cache directory; (max error, FX cache hits)."""
    import os

    import torch._inductor.config as inductor_config
    import torch.nn.functional as F
    from helpers import make_qkv, max_err
    from torch._dynamo.utils import counters

    import cp_compile

    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        torch._dynamo.reset()
        counters.clear()
        plan = cp_compile.ContextParallel(schedule="ring")  # the ring's graphs and traffic are what is checked
        q, k, v, dout = make_qkv(1, 2, 2, local_len * plan.world_size, 8)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=True).backward(dout)
        local = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
        with inductor_config.patch(fx_graph_cache=True):
            fn = torch.compile(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                backend=plan.backend("inductor"),
                fullgraph=True,
            )
            fn(*local).backward(plan.shard(dout, 2))
        err = max(max_err(a.grad, plan.shard(b.grad, 2)) for a, b in zip(local, ref))
        return err, counters["inductor"]["fxgraph_cache_hit"]
    finally:
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def test_cache_shared_by_world_sizes_never_serves_another_c(ranks, tmp_path):
    """Same local shapes at C=2 and C=4 give the same Dynamo graph; the ring differs (C steps),
    so the cache key must hold C or C=4 would run a cached 2-step ring."""
    cache = str(tmp_path / "cache")
    for world_size in (2, 4, 2):
        results = ranks(world_size, attention_with_cache, cache, 8, timeout=600)
        assert all(err < 1e-10 for err, _ in results), f"C={world_size}"
    assert results[-1][1] >= 2  # the second C=2 run came from the cache: the key still hits where it should


def prefill_parity(grad_mode: str):
    """Inference prefill: the compiled model under no_grad / inference_mode against one device;
    the eager op under the same mode."""
    import torch.nn.functional as F
    from helpers import make_qkv, max_err
    from torch._dynamo.utils import counters

    import cp_compile
    from cp_compile.comm.ring import TAG_DKV, TAG_KV
    from cp_compile.tools.llama import Llama, LlamaConfig

    torch._dynamo.reset()
    counters.clear()
    plan = cp_compile.ContextParallel(schedule="ring")
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = Llama(cfg).double()
    tokens = torch.randint(0, cfg.vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = model(tokens, torch.arange(SEQ))
    backend = plan.backend("inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    # a warm FX cache would skip the passes, and with them the records checked below
    with mode, torch._inductor.config.patch(force_disable_caches=True), cp_compile.count_traffic() as traffic:
        logits = compiled(plan.shard(tokens, 1), plan.positions(SEQ))
    q, k, v, _ = make_qkv(1, 4, 2, 8 * plan.world_size, 8)
    with mode:
        eager_out = cp_compile.ring_attention(*(plan.shard(t, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    eager_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return {
        "logits_err": (logits - plan.shard(ref_logits, 1)).abs().max().item(),
        "eager_err": max_err(eager_out, plan.shard(eager_ref, 2)),
        "graph_breaks": sum(counters["graph_break"].values()),
        "expansions": sorted(e.direction for r in backend.records for e in r.expansions),
        "kv_shifts": traffic.by_tag.get(TAG_KV, 0),
        "dkv_shifts": traffic.by_tag.get(TAG_DKV, 0),
    }


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_prefill_without_grad_compiled(ranks, grad_mode):
    """No joint graph is traced without grad: the inference graph takes the forward ring alone."""
    for result in ranks(2, prefill_parity, grad_mode, timeout=600):
        assert result["graph_breaks"] == 0
        assert result["expansions"] == ["forward", "forward"]
        assert result["kv_shifts"] == 2 and result["dkv_shifts"] == 0  # two layers, C - 1 hops each
        assert result["logits_err"] < 1e-10 and result["eager_err"] < 1e-10
