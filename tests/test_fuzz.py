"""Bad and unusual input on 2 to 4 gloo ranks: every case ends alike on every rank, in one of two ways.

Either every rank's result is exact against one device (fp64, 1e-10; NaN exactly where one device has
NaN), or every rank raises the same type of error, whose message names the problem (``Case.words``).
Anything else fails the case: a hang (the per-case timeout turns it into a failure), one rank raising
while another returns, a crash, an error that names something else, a wrong answer.

Deviations are on rank 1 only ("one rank") or on every rank ("all ranks"). Each case is a function of
no arguments that runs on every rank and returns its largest error against one device; the registry
``CASES`` is rebuilt by importing this module in each rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import make_qkv

EXACT = 1e-10
TIMEOUT = 20.0  # seconds per case on warm ranks; the gloo timeout is 60 s, so a hang fails here first


@dataclass(frozen=True)
class Case:
    run: Callable[[], float]
    error: str = ""  # the error type every rank raises; "" for a valid input (exact)
    words: tuple[str, ...] = ()  # what every rank's message says
    sizes: tuple[int, ...] = (2, 3, 4)
    timeout: float = TIMEOUT


CASES: dict[str, Case] = {}


def case(name: str, run: Callable[[], float], error: str = "", words=(), **more) -> None:
    assert name not in CASES, name
    CASES[name] = Case(run, error, tuple([words] if isinstance(words, str) else words), **more)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _err(got: torch.Tensor, want: torch.Tensor | None) -> float:
    """Largest difference where one device's answer is finite; infinite where CP's is not finite there, or where
    one device has no answer. (Where one device's is NaN, a row saw a NaN key: torch's own kernels then
    disagree among themselves, the CPU flash kernel returning a finite row for some, so those rows are not
    compared; what is checked is that masked keys never reach a row.)"""
    if want is None or got.shape != want.shape:
        return float("inf")
    finite = torch.isfinite(want)
    if not torch.isfinite(got[finite]).all():
        return float("inf")
    diff = (got.double() - want.double()).abs()[finite]
    return float(diff.max()) if diff.numel() else 0.0


# ----------------------------------------------------------------------------
# Dense attention: every schedule, eager and compiled.
# ----------------------------------------------------------------------------

DENSE = dict(
    schedule="ring",
    causal=True,
    b=1,
    hq=2,
    hkv=2,
    per_rank=4,  # local tokens; the global length is C times that
    d=4,
    dv=4,
    layout="zigzag",
    scale=None,
    dtypes=("float64", "float64", "float64"),
    gqa=None,  # enable_gqa; None: where q has more heads than k/v
    ndim=4,
    poison=None,  # (what, global token, value): a key or value row set to NaN or inf
    dropout=0.0,
    compiled=False,
)


def dense(one: dict | None = None, **every) -> Callable[[], float]:
    """A dense call of ``DENSE`` changed by ``every`` on every rank and by ``one`` on rank 1 only."""
    return functools.partial(_dense, every, one or {})


def _dense(every: dict, one: dict) -> float:
    import cp_compile

    cfg = {**DENSE, **every, **(one if _rank() == 1 else {})}
    group = None
    if cfg["schedule"] == "hybrid":  # a 2-D (ring, a2a) mesh over the four ranks
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "a2a"))
    plan = cp_compile.ContextParallel(group, load_balance=cfg["layout"])
    seq = cfg["per_rank"] * plan.world_size
    q, k, v, _ = make_qkv(cfg["b"], cfg["hq"], cfg["hkv"], seq, cfg["d"], dv=cfg["dv"])
    if cfg["poison"] is not None:
        what, token, value = cfg["poison"]
        (k if what == "k" else v)[:, :, token % seq] = value
    gqa = cfg["hq"] != cfg["hkv"] if cfg["gqa"] is None else cfg["gqa"]
    kwargs = dict(is_causal=cfg["causal"], scale=cfg["scale"], enable_gqa=gqa)
    want = _reference(lambda: plan.shard(F.scaled_dot_product_attention(q, k, v, **kwargs), 2))
    local = [plan.shard(t, 2).to(getattr(torch, dtype)) for t, dtype in zip((q, k, v), cfg["dtypes"])]
    if cfg["ndim"] == 3:
        local = [t[0] for t in local]
    if cfg["compiled"]:
        run = torch.compile(
            functools.partial(F.scaled_dot_product_attention, **kwargs),
            backend=plan.backend("aot_eager"),
            fullgraph=True,
            dynamic=False,
        )
        with plan:
            got = run(*local)
    else:
        attention = getattr(cp_compile, f"{cfg['schedule']}_attention")
        extra = {"layout": cfg["layout"], **({"mesh": group} if group is not None else {})}
        if cfg["dropout"]:
            extra["dropout_p"] = cfg["dropout"]
        got = attention(*local, **kwargs, **extra)
    return _err(got, want)


def _masked_reference(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    """Attention where ``visible [Lq, Lk]`` says, by replacing masked scores (an additive mask, as torch's SDPA
    takes a boolean one, lets a masked key's NaN through)."""
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v  # every row of these cases sees a key


def _reference(compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """One device's answer; None where one device refuses the input (CP must then refuse it too)."""
    try:
        return compute()
    except Exception:  # noqa: BLE001  (whatever one device raises, CP must refuse the input too)
        return None


for schedule in ("ring", "allgather", "ulysses"):
    s = dict(schedule=schedule)
    # one rank differs: caught by the agreement before any transfer
    for name, one in {
        "length": dict(per_rank=8),
        "causal": dict(causal=False),
        "heads": dict(hq=4, hkv=4),
        "kv-heads": dict(hkv=1, gqa=True),
        "head-dim": dict(d=8, dv=8),
        "v-dim": dict(dv=6),
        "batch": dict(b=2),
        "scale": dict(scale=0.25),
        "layout": dict(layout="contiguous"),
        "q-dtype": dict(dtypes=("float32", "float32", "float32")),
        "k-dtype": dict(dtypes=("float64", "float32", "float64")),
        "v-dtype": dict(dtypes=("float64", "float64", "float32")),
        "ndim": dict(ndim=3),
    }.items():
        case(f"{schedule} one rank: {name}", dense(one, **s), "ValueError", "ranks disagree")
    case(
        f"{schedule} one rank: schedule",
        dense({"schedule": "ring" if schedule != "ring" else "allgather"}, **s),
        "ValueError",
        "ranks disagree",
    )
    # every rank alike, but not something attention can take
    case(
        f"{schedule} all ranks: k in another dtype",
        dense(dtypes=("float64", "float32", "float64"), **s),
        "ValueError",
        "dtype",
    )
    case(f"{schedule} all ranks: 3-D tensors", dense(ndim=3, **s), "ValueError", "[B, H, L, D]")
    case(
        f"{schedule} all ranks: fewer k/v heads without enable_gqa",
        dense(hkv=1, gqa=False, **s),
        "ValueError",
        "enable_gqa",
    )
    case(f"{schedule} all ranks: q heads not a multiple", dense(hq=3, hkv=2, **s), "ValueError", "multiple")
    case(f"{schedule} all ranks: integer tensors", dense(dtypes=("int64",) * 3, **s), "ValueError", "dtype")
    # valid, and exact: edge cases (the all-to-all shards heads: 12 split over 2, 3 and 4 ranks)
    h = dict(hq=12, hkv=12) if schedule == "ulysses" else {}
    case(f"{schedule} one-token chunks", dense(per_rank=2, **{"hq": 4, "hkv": 4, **h}, **s))
    case(f"{schedule} non-causal contiguous", dense(causal=False, layout="contiguous", **h, **s))
    case(f"{schedule} GQA, value dim, batch, scale", dense(dv=6, b=2, scale=0.3, **{"hq": 4, "hkv": 2, **h}, **s))
    for value in ("nan", "inf", "-inf"):
        # the last token's key: only the last query may see it; every other row stays exact and finite
        case(f"{schedule} {value} in a masked key", dense(poison=("k", -1, float(value)), per_rank=8, **h, **s))

case("hybrid exact", dense(schedule="hybrid", hq=4, hkv=4), sizes=(4,))
case(
    "hybrid nan in a masked key",
    dense(poison=("k", -1, float("nan")), per_rank=8, schedule="hybrid", hq=4, hkv=4),
    sizes=(4,),
)
case(
    "hybrid one rank: length",
    dense(dict(per_rank=8), schedule="hybrid", hq=4, hkv=4),
    "ValueError",
    "ranks disagree",
    sizes=(4,),
)
case(
    "hybrid all ranks: heads not divisible by the all-to-all",
    dense(schedule="hybrid", hq=1, hkv=1),
    "ValueError",
    "heads",
    sizes=(4,),
)
case("ring all ranks: dropout", dense(dropout=0.1), "NotImplementedError", "dropout_p=0.1")
case(
    "ulysses all ranks: heads not divisible by C",
    dense(schedule="ulysses", hq=1, hkv=1),
    "ValueError",
    "divid",
    sizes=(2, 3, 4),
)
case("ring all ranks: unknown layout", dense(layout="spiral"), "ValueError", "spiral")

# (k in another dtype on one rank, or a BlockMask of another length, is refused by torch itself while that rank
# traces: an error of the user's program before any collective of ours, which no library call can carry to the
# other ranks)
for name, one in {"length": dict(per_rank=8), "causal": dict(causal=False), "heads": dict(hq=4, hkv=4)}.items():
    case(
        f"compiled one rank: {name}",
        dense(one, compiled=True),
        "ValueError",
        "ranks disagree",
        sizes=(2, 3, 4),
        timeout=50.0,
    )
case(
    "compiled nan in a masked key",
    dense(poison=("k", -1, float("nan")), per_rank=8, compiled=True),
    sizes=(2, 3, 4),
    timeout=50.0,
)

for name, one in {"dropout": dict(dropout=0.1), "scale": dict(scale="x")}.items():
    case(f"ring one rank refuses: {name}", dense(one), "ValueError", "refused this call")


# ----------------------------------------------------------------------------
# The plan's layout functions.
# ----------------------------------------------------------------------------


def layout_call(call: str, one: bool = False) -> Callable[[], float]:
    return functools.partial(_layout_call, call, one)


def _layout_call(call: str, one: bool) -> float:
    import cp_compile

    plan = cp_compile.ContextParallel()
    c, deviate = plan.world_size, not one or _rank() == 1
    seq = 4 * c
    x = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cu = torch.tensor([0, 1, 5, 5, seq], dtype=torch.int32)
    local = plan.shard(x, 1)
    if call == "shard: missing dim":
        plan.shard(x, 3 if deviate else 1)
    elif call == "shard: negative dim":
        return _err(plan.shard(x, -2), local)
    elif call == "unshard: negative dim":
        return _err(plan.unshard(local, -2), x)
    elif call == "unshard: other local length":
        return _err(plan.unshard(torch.cat([local, local], 1) if deviate else local, 1), x)
    elif call == "unshard: other dtype":
        return _err(plan.unshard(local.float() if deviate else local, 1), x)
    elif call == "unshard: other seq_dim":
        return _err(plan.unshard(local.transpose(0, 1).contiguous() if deviate else local, 0 if deviate else 1), x)
    elif call == "unshard: missing dim":
        plan.unshard(local, 5 if deviate else 1)
    elif call == "unshard packed: the whole tensor":
        return _err(plan.unshard(x if deviate else plan.shard(x, 1, cu_seqlens=cu), 1, cu_seqlens=cu), x)
    elif call == "unshard packed: exact":
        return _err(plan.unshard(plan.shard(x, 1, cu_seqlens=cu), 1, cu_seqlens=cu), x)
    elif call == "unshard packed: other documents":
        other = torch.tensor([0, 2, 5, 5, seq], dtype=torch.int32) if deviate else cu
        return _err(plan.unshard(plan.shard(x, 1, cu_seqlens=other), 1, cu_seqlens=other), x)
    elif call == "shard packed: nan in a padding row":
        from cp_compile.layout.packed import packed_slots

        y = x.clone()
        y[:, 0] = float("nan")  # the first document, one token: the row every padding slot is copied from
        slots = packed_slots(cu, plan.rank, c)
        got = plan.shard(y, 1, cu_seqlens=cu)
        padding_zero = bool((got[:, ~slots["real"]] == 0).all())
        real = torch.equal(got[:, slots["real"]].nan_to_num(7.0), y[:, slots["index"][slots["real"]]].nan_to_num(7.0))
        return 0.0 if padding_zero and real else float("inf")
    elif call == "shard packed: bad cu_seqlens":
        plan.shard(x, 1, cu_seqlens=torch.tensor([0, 5, 3, seq]))
    elif call == "shard packed: cu_seqlens short of the length":
        plan.shard(x, 1, cu_seqlens=torch.tensor([0, 5, seq - 1]))
    elif call == "positions: no length":
        plan.positions()
    elif call == "positions: a length the layout cannot split":
        plan.positions(seq + 1)
    else:
        raise KeyError(call)
    return 0.0


for name, error, words in [
    ("shard: missing dim", "ValueError", "seq_dim=3"),
    ("unshard: missing dim", "ValueError", "seq_dim=5"),
    ("unshard packed: the whole tensor", "ValueError", "slots"),
    ("shard packed: bad cu_seqlens", "ValueError", "cu_seqlens"),
    ("shard packed: cu_seqlens short of the length", "ValueError", "cu_seqlens"),
    ("positions: no length", "ValueError", "seq_len"),
    ("positions: a length the layout cannot split", "ValueError", "does not split"),
]:
    case(f"all ranks {name}", layout_call(name), error, words)
for name in (
    "shard: negative dim",
    "unshard: negative dim",
    "unshard packed: exact",
    "shard packed: nan in a padding row",
):
    case(name, layout_call(name))
for name in [
    "unshard: other local length",
    "unshard: other dtype",
    "unshard: other seq_dim",
    "unshard packed: the whole tensor",
    "unshard packed: other documents",
]:
    case(f"one rank {name}", layout_call(name, one=True), "ValueError", "ranks disagree")


# ----------------------------------------------------------------------------
# FlexAttention: the BlockMask as every rank shards it.
# ----------------------------------------------------------------------------


def flex(mask: str = "causal", one_mask: str | None = None, schedule: str = "auto", **more) -> Callable[[], float]:
    return functools.partial(_flex, mask, one_mask, schedule, more)


def _flex(mask: str, one_mask, schedule: str, more: dict) -> float:
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile
    from cp_compile import masks

    plan = cp_compile.ContextParallel()
    c, per_rank = plan.world_size, 8
    if _rank() == 1 and one_mask is not None:
        mask = one_mask
    seq = per_rank * c * (2 if mask == "causal, twice the length" else 1)
    mods = {"causal": masks.causal(), "window": masks.sliding_window(3), "causal, twice the length": masks.causal()}
    mask_mod = mods.get(mask)
    q, k, v, _ = make_qkv(1, 2, 2, seq, 4)
    q, k, v = q[:, :, : per_rank * c], k[:, :, : per_rank * c], v[:, :, : per_rank * c]
    if more.get("poison"):
        k[:, :, -1] = float(more["poison"])
    n = per_rank * c
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = mask_mod(0, 0, qi, ki) if mask_mod is not None else torch.ones(n, n, dtype=torch.bool)
    want = plan.shard(_masked_reference(q, k, v, visible), 2)
    if mask == "unsharded":
        block_mask = create_block_mask(masks.causal(), None, None, n, n, device="cpu", BLOCK_SIZE=4)
    elif mask_mod is None:
        block_mask = None
    else:
        block_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=4))
    local = [plan.shard(t, 2) for t in (q, k, v)]
    if more.get("compiled"):
        from torch.nn.attention.flex_attention import flex_attention

        with plan:
            got = torch.compile(flex_attention, backend=plan.backend("aot_eager"), fullgraph=True)(
                *local, block_mask=block_mask
            )
    else:
        got = cp_compile.flex_attention(*local, block_mask=block_mask, schedule=schedule)
    return _err(got, want)


for schedule in ("auto", "ring", "allgather"):
    f = dict(schedule=schedule)
    case(f"flex {schedule} exact: window", flex("window", **f))
    case(f"flex {schedule} nan in a masked key", flex("causal", poison="nan", **f))
    case(f"flex {schedule} one rank: another mask", flex("causal", "window", **f), "ValueError", "ranks disagree")
    case(f"flex {schedule} one rank: no mask", flex("causal", "none", **f), "ValueError", "ranks disagree")
    case(
        f"flex {schedule} one rank: a mask of another length",
        flex("causal", "causal, twice the length", **f),
        "ValueError",
        "ranks disagree",
    )
    case(
        f"flex {schedule} one rank: an unsharded mask",
        flex("causal", "unsharded", **f),
        "ValueError",
        "refused this call",
    )
    case(f"flex {schedule} all ranks: an unsharded mask", flex("unsharded", **f), "ValueError", "not sharded")

case("compiled flex exact: window", flex("window", compiled=True), sizes=(2, 3, 4), timeout=50.0)
case(
    "compiled flex one rank: another mask",
    flex("causal", "window", compiled=True),
    "ValueError",
    "ranks disagree",
    sizes=(2, 3, 4),
    timeout=50.0,
)


# ----------------------------------------------------------------------------
# Packed documents (varlen).
# ----------------------------------------------------------------------------


def varlen(lengths=(5, 0, 2, 9), one: dict | None = None, **every) -> Callable[[], float]:
    return functools.partial(_varlen, tuple(lengths), every, one or {})


def _varlen(lengths: tuple, every: dict, one: dict) -> float:
    import cp_compile

    cfg = {"schedule": "auto", "window": (-1, 0), "poison": None, "cu": None, **every, **(one if _rank() == 1 else {})}
    heads = 12 if cfg["schedule"] == "ulysses" else 2  # the all-to-all shards heads: 12 split over 2, 3, 4 ranks
    plan = cp_compile.ContextParallel()
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if cfg["poison"] is not None:  # the last token of the first document: no other document may see it
        k[lengths[0] - 1] = float(cfg["poison"])
    pieces = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if b > a:
            n = b - a
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            left, right = cfg["window"]
            seen = (j <= i + right if right >= 0 else torch.ones(n, n, dtype=torch.bool)) & (
                j >= i - left if left >= 0 else True
            )
            pieces.append(_masked_reference(*(t[a:b].transpose(0, 1) for t in (q, k, v)), seen).transpose(0, 1))
    want = plan.shard(torch.cat(pieces), 0, cu_seqlens=cu)
    given = torch.tensor(cfg["cu"], dtype=torch.int32) if cfg["cu"] is not None else cu
    local = [plan.shard(t, 0, cu_seqlens=cu) for t in (q, k, v)]
    if cfg.get("compiled"):
        from torch.nn.attention.varlen import varlen_attn

        longest = max(lengths)

        def model(q, k, v, cu):
            return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=cfg["window"])

        with plan:
            got = torch.compile(model, backend=plan.backend("aot_eager"), fullgraph=True)(*local, given)
    else:
        got = cp_compile.varlen_attention(*local, given, window_size=cfg["window"], schedule=cfg["schedule"])
    real = plan.positions(cu_seqlens=cu) >= 0
    from cp_compile.layout.packed import packed_slots

    real = packed_slots(cu, plan.rank, plan.world_size)["real"]
    return _err(got[real], want[real])


for schedule in ("auto", "ring", "allgather", "ulysses"):
    w = dict(schedule=schedule)
    case(f"varlen {schedule} exact: empty and short documents", varlen(**w))
    case(f"varlen {schedule} exact: one-token documents", varlen((1, 1, 1, 3), **w))
    case(f"varlen {schedule} exact: window", varlen(window=(2, 0), **w))
    case(f"varlen {schedule} nan in another document's key", varlen(poison="nan", **w))
    case(f"varlen {schedule} one rank: other documents", varlen(one=dict(cu=[0, 4, 5, 7, 16]), **w), "ValueError", "")
    case(
        f"varlen {schedule} one rank: another window",
        varlen(one=dict(window=(3, 0)), **w),
        "ValueError",
        "ranks disagree",
    )
    case(
        f"varlen {schedule} one rank: a bad window",
        varlen(one=dict(window=(-5, 0)), **w),
        "ValueError",
        "refused this call",
    )
COMPILED = dict(sizes=(2, 3, 4), timeout=50.0)
case(
    "compiled varlen: empty and short documents, nan in another document's key",
    varlen(poison="nan", compiled=True),
    **COMPILED,
)
case(
    "compiled varlen one rank: other documents",
    varlen(one=dict(cu=[0, 4, 5, 7, 16]), compiled=True),
    "ValueError",
    "cu_seqlens differs",
    **COMPILED,
)
case(
    "compiled varlen one rank: another window",
    varlen(one=dict(window=(3, 0)), compiled=True),
    "ValueError",
    "ranks disagree",
    **COMPILED,
)
case("varlen all ranks: cu_seqlens not from 0", varlen(cu=[1, 5, 5, 7, 16]), "ValueError", "cu_seqlens")
case("varlen all ranks: unknown schedule", varlen(schedule="spiral"), "ValueError", "spiral")
case("varlen one rank: unknown schedule", varlen(one=dict(schedule="spiral")), "ValueError", "refused this call")


# ----------------------------------------------------------------------------
# Token mixers that are not attention: a short convolution, a linear recurrence.
# ----------------------------------------------------------------------------


def mixer(which: str, one: dict | None = None, **every) -> Callable[[], float]:
    return functools.partial(_mixer, which, every, one or {})


def _mixer(which: str, every: dict, one: dict) -> float:
    import cp_compile
    from cp_compile.mixers import Sharding
    from cp_compile.mixers.conv import causal_conv1d, depthwise_causal_conv1d

    cfg = {"per_rank": 4, "width": 4, "channels": 3, **every, **(one if _rank() == 1 else {})}
    plan = cp_compile.ContextParallel()
    seq = cfg["per_rank"] * plan.world_size
    g = torch.Generator().manual_seed(0)
    sharding = Sharding(plan.group_name, plan.world_size, plan.load_balance)
    if which == "conv":
        x = torch.randn(1, cfg["channels"], seq, generator=g, dtype=torch.float64)
        w = torch.randn(cfg["channels"], cfg["width"], generator=g, dtype=torch.float64)
        want = plan.shard(depthwise_causal_conv1d(x, w, None, "silu"), 2)
        return _err(causal_conv1d(plan.shard(x, 2), w, None, "silu", sharding), want)
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as scan

    from cp_compile.mixers.scan import gated_delta_rule

    heads = cfg["channels"]
    q, k = (torch.randn(1, seq, heads, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, seq, heads, 3, generator=g, dtype=torch.float64)
    gate, beta = (torch.rand(1, seq, heads, generator=g, dtype=torch.float64) for _ in range(2))
    gate = -gate
    kw = dict(chunk_size=4, use_qk_l2norm_in_kernel=True)
    want = plan.shard(scan(q, k, v, gate, beta, **kw)[0], 1)
    local = [plan.shard(t, 1) for t in (q, k, v, gate, beta)]
    return _err(gated_delta_rule(scan, *local, sharding, **kw)[0], want)


for which in ("conv", "gdn"):
    case(f"{which} exact: two tokens a rank", mixer(which, per_rank=2))
    case(f"{which} one rank: another length", mixer(which, one=dict(per_rank=8)), "ValueError", "ranks disagree")
    case(f"{which} one rank: other channels", mixer(which, one=dict(channels=5)), "ValueError", "ranks disagree")
case("conv one rank: another width", mixer("conv", one=dict(width=2)), "ValueError", "ranks disagree")


# ----------------------------------------------------------------------------
# Decoding against a sharded KV cache; a process outside the plan's group.
# ----------------------------------------------------------------------------


def cached(one: dict | None = None, **every) -> Callable[[], float]:
    return functools.partial(_cached, every, one or {})


def _cached(every: dict, one: dict) -> float:
    import cp_compile

    cfg = {"queries": 1, "window": None, "cache_dtype": "float64", **every, **(one if _rank() == 1 else {})}
    plan = cp_compile.ContextParallel(load_balance="contiguous")
    c, n = plan.world_size, 6
    seq = n * c
    q_all, k, v, _ = make_qkv(1, 4, 2, seq + cfg["queries"], 4)
    q = q_all[:, :, seq:]
    k, v = k[:, :, :seq], v[:, :, :seq]
    q_pos = torch.arange(seq, seq + cfg["queries"])
    visible = (torch.arange(seq)[None, :] <= q_pos[:, None]) & (
        torch.arange(seq)[None, :] > q_pos[:, None] - cfg["window"] if cfg["window"] else True
    )
    want = _masked_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), visible)
    mine = slice(plan.rank * n, (plan.rank + 1) * n)
    dtype = getattr(torch, cfg["cache_dtype"])
    got = cp_compile.cached_attention(
        q, k[:, :, mine].to(dtype), v[:, :, mine].to(dtype), q_pos, torch.arange(seq)[mine], window=cfg["window"]
    )
    return _err(got, want)


case("cached exact: window", cached(window=4))
case("cached one rank: more queries", cached(dict(queries=2)), "ValueError", "ranks disagree")
case("cached one rank: another window", cached(dict(window=3)), "ValueError", "ranks disagree")
case(
    "cached one rank: a cache in another dtype", cached(dict(cache_dtype="float32")), "ValueError", "refused this call"
)


def outside_the_group() -> float:
    """The group of every rank but the last: its members run CP exactly; the last rank, given the placeholder
    ``new_group`` returns to the ranks it leaves out, is told it is not a member (and runs nothing)."""
    import torch.distributed as dist

    import cp_compile

    c = dist.get_world_size()
    group = dist.new_group(list(range(c - 1)))
    try:
        plan = cp_compile.ContextParallel(group)
    except ValueError as e:
        if dist.get_rank() == c - 1 and "not a member" in str(e):
            return 0.0
        raise
    q, k, v, _ = make_qkv(1, 2, 2, 4 * (c - 1), 4)
    got = cp_compile.ring_attention(*(plan.shard(t, 2) for t in (q, k, v)), group=group, is_causal=True)
    return _err(got, plan.shard(F.scaled_dot_product_attention(q, k, v, is_causal=True), 2))


case("a process outside the plan's group", outside_the_group)

# ----------------------------------------------------------------------------
# The test: one case on C ranks, classified.
# ----------------------------------------------------------------------------


def run_case(name: str):
    """On every rank: ("ran", error against one device) or ("raised", type, message)."""
    try:
        return ("ran", CASES[name].run())
    except Exception as e:  # noqa: BLE001  (classified by the caller)
        return ("raised", type(e).__name__, str(e))


def classify(case: Case, results: list) -> str:
    """What went wrong; the empty string when the case ended as it must on every rank."""
    if case.error:
        if any(r[0] != "raised" for r in results):
            return f"expected {case.error} on every rank; got {results}"
        if any(r[1] != case.error or not all(w in r[2] for w in case.words) for r in results):
            return f"expected {case.error} naming {case.words} on every rank; got {results}"
        return ""
    if any(r[0] != "ran" or not r[1] <= EXACT for r in results):
        return f"expected exact results on every rank; got {results}"
    return ""


PARAMS = [pytest.param(name, c, id=f"{name} C{c}") for name, spec in CASES.items() for c in spec.sizes]


@pytest.mark.parametrize("name,world_size", PARAMS)
def test_fuzz(ranks, name, world_size):
    spec = CASES[name]
    try:
        results = ranks(world_size, run_case, name, timeout=spec.timeout)
    except Exception as e:  # noqa: BLE001  (a hang, a crash: the pool restarts its ranks)
        pytest.fail(f"{name} on {world_size} ranks did not end on every rank: {type(e).__name__}: {e}")
    problem = classify(spec, results)
    if problem:  # a rank may be left waiting, or the group broken by a timeout: the next case gets fresh ranks
        ranks.restart(world_size)
    assert not problem, problem
