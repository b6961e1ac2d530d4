"""Every kind of attention under every schedule, through the one implementation per schedule, fp64.

Dense SDPA (causal), a FlexAttention BlockMask (documents + causal) and packed
documents (a causal window) each run the ring, the all-gather, Ulysses and the
hybrid at C = 1, 2, 3, 4 against single-device attention: out and dq, dk, dv.
12 query heads split over every C and every all-to-all size; 4 K/V heads are
replicated where they do not (C = 3). The hybrid meshes are (1, 1), (1, 2),
(3, 1) and (2, 2): a one-group ring, a ring of single ranks, and both at once.
"""

import pytest
from helpers import make_qkv, max_err, sdpa_with_grads
from test_flex import mask_case
from test_flex import reference as flex_reference
from test_varlen import packed_inputs, per_document_reference

SCHEDULES = ("ring", "allgather", "ulysses", "hybrid")
MESHES = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}
HQ, HKV, D, CHUNK = 12, 4, 8, 3


def _group(plan_world: int, schedule: str):
    if schedule != "hybrid":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", MESHES[plan_world], mesh_dim_names=("ring", "a2a"))


def _backward(out, do, leaves):
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def run_sdpa(plan, schedule, group):
    import cp_compile

    q, k, v, do = make_qkv(1, HQ, HKV, 2 * plan.world_size * CHUNK, D, seed=1)
    ref = sdpa_with_grads(q, k, v, do, is_causal=True)
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    attention = getattr(cp_compile, f"{schedule}_attention")
    out = attention(*leaves, group if group is not None else plan.group_name, is_causal=True, enable_gqa=True)
    got = _backward(out, plan.shard(do, 2), leaves)
    return [max_err(g, plan.shard(w, 2)) for g, w in zip(got, ref)]


def run_flex(plan, schedule, group):
    from torch.nn.attention.flex_attention import create_block_mask

    import cp_compile

    seq = 2 * plan.world_size * CHUNK
    mask_mod, _ = mask_case("document-causal", seq, CHUNK)
    q, k, v, do = make_qkv(1, HQ, HKV, seq, D, seed=2)
    out_ref, _, *grads_ref = flex_reference(q, k, v, do, mask_mod, None, 0.3)
    block_mask = plan.shard(create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=CHUNK))
    leaves = [plan.shard(t, 2).requires_grad_() for t in (q, k, v)]
    out = cp_compile.flex_attention(
        *leaves, block_mask=block_mask, scale=0.3, enable_gqa=True, group=group, schedule=schedule
    )
    got = _backward(out, plan.shard(do, 2), leaves)
    return [max_err(g, plan.shard(w, 2)) for g, w in zip(got, [out_ref, *grads_ref])]


def run_packed(plan, schedule, group):
    import cp_compile

    q, k, v, do, cu = packed_inputs([13, 1, 0, 3, 8], HQ, HKV, D, seed=3)
    window = (3, 0)
    ref = per_document_reference(q, k, v, do, cu, window)
    shard = lambda t: plan.shard(t, 0, cu_seqlens=cu)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out = cp_compile.varlen_attention(*leaves, cu, group, window_size=window, enable_gqa=True, schedule=schedule)
    got = _backward(out, shard(do), leaves)
    return [max_err(g, shard(w)) for g, w in zip(got, ref)]  # padding slots: zeros on both sides


KINDS = {"sdpa": run_sdpa, "flex": run_flex, "packed": run_packed}


def every_kind_and_schedule():
    import torch.distributed as dist

    import cp_compile

    errors = {}
    for schedule in SCHEDULES:
        group = _group(dist.get_world_size(), schedule)
        plan = cp_compile.ContextParallel(group)
        for kind, run in KINDS.items():
            errors[kind, schedule] = run(plan, schedule, group)
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_kind_runs_every_schedule(ranks, world_size):
    for per_rank in ranks(world_size, every_kind_and_schedule, timeout=300):
        assert set(per_rank) == {(kind, s) for kind in KINDS for s in SCHEDULES}
        for case, errs in per_rank.items():
            assert len(errs) == 4 and max(errs) < 1e-10, (case, errs)


def test_settings_travel_as_one_string_and_back():
    """A kind's typed settings are the ops' ``options`` string written by ``encode`` and read by ``decode``, the
    one dialect: every field comes back with its type, defaults are left out, and what is not the kind's raises."""
    from cp_compile.inference.cached import CachedSettings
    from cp_compile.kinds.call import Call
    from cp_compile.kinds.flex import FlexSettings
    from cp_compile.kinds.packed import PackedSettings

    for settings in (PackedSettings(-1, 0, 48, 5.0), PackedSettings(3, 2), FlexSettings(2, 12), CachedSettings(4)):
        assert type(settings).decode(settings.encode()) == settings
    assert PackedSettings(7, 0).encode() == "left=7 right=0" and FlexSettings().encode() == ""
    with pytest.raises(ValueError, match="are not PackedSettings"):
        PackedSettings.decode("right=0")  # no left
    with pytest.raises(ValueError, match="are not FlexSettings"):
        FlexSettings.decode("window=3,0")
    packed = Call("packed", ("g",), False, "contiguous", 0.5, PackedSettings(4, 0, 0, 1.5))
    tensors, back, flag = Call.from_op_args(("q", "k", *packed.op_args(True)), 2)
    assert (tensors, back, flag) == (("q", "k"), packed, True)
    with pytest.raises(ValueError, match="the sdpa kind takes no settings"):
        Call.decoded("sdpa", ("g",), True, "zigzag", 0.5, "left=1")
