"""The benchmark end to end on the session's gloo rank pools (tiny configuration)."""

import json
import math
import os

import pytest
import torch

from cp_compile.tools import bench


def plugin_setup(problem, inputs):
    """A variant registered from outside cp_compile.tools.bench: ours again, under another name."""
    return bench._ours_setup(problem, inputs)


def broken_setup(problem, inputs):
    """A wrong baseline: must be reported invalid and never timed."""

    def step():
        z = torch.zeros_like(inputs.q)
        return z, z, torch.zeros_like(inputs.k), torch.zeros_like(inputs.v)

    return step


PLUGIN, BROKEN = "plugin hook check", "broken on purpose"


@pytest.fixture(scope="module")
def tiny_results(ranks, tmp_path_factory):
    bench.register_variant(bench.Variant(PLUGIN, plugin_setup, "test: ours via the registry", meter=bench._ours_meter))
    bench.register_variant(bench.Variant(BROKEN, broken_setup, "test: returns zeros"))
    try:
        opts = bench.BenchOptions(**bench.TINY)
        lines = []
        results = bench.run_benchmark(opts, ranks, log=lines.append)
    finally:
        del bench.VARIANTS[PLUGIN], bench.VARIANTS[BROKEN]
    out = tmp_path_factory.mktemp("bench") / "results.json"
    png = bench.write_outputs(results, out)
    return json.loads(out.read_text()), png, lines, opts


BUILTIN = [bench.OURS, bench.TORCH_A2A, bench.TORCH_AG, bench.SINGLE]


def test_every_variant_has_finite_positive_times(tiny_results):
    data, _, _, opts = tiny_results
    assert len(data["configs"]) == len(opts.world_sizes) * len(opts.seq_lens) * 2
    for cfg in data["configs"]:
        for name in BUILTIN + [PLUGIN]:
            e = cfg["variants"][name]
            assert e["valid"], (cfg["config"], name, e["max_rel_err"])
            assert e["max_rel_err"] < 1e-4
            assert math.isfinite(e["time_s"]) and e["time_s"] > 0, (cfg["config"], name)
            assert len(e["times_s"]) == opts.repeats
            assert e["peak_bytes"] >= 0 and e["q_bytes"] > 0


def test_wrong_variant_is_invalid_and_not_timed(tiny_results):
    data, _, lines, _ = tiny_results
    for cfg in data["configs"]:
        e = cfg["variants"][BROKEN]
        assert not e["valid"] and e["max_rel_err"] > 0.1
        assert "time_s" not in e
    assert all("broken" in line and "INVALID" in line for line in lines[1:])


def test_traffic_and_derived_metrics(tiny_results):
    data, _, _, _ = tiny_results
    for cfg in data["configs"]:
        c, v = cfg["config"], cfg["variants"]
        world = c["world_size"]
        kv_bytes = 2 * c["batch"] * c["heads"] * (c["seq_len"] // world) * c["head_dim"] * 4  # fp32 K and V
        # forward C-1 K/V hops; backward C-1 K/V hops and C fp32 dK/dV hops (none at C=1)
        expected = (3 * world - 2) * kv_bytes if world > 1 else 0
        for name in (bench.OURS, bench.TORCH_A2A, bench.TORCH_AG, PLUGIN):
            assert v[name]["bytes_per_rank"] == expected, (c, name)
            assert v[name]["parallel_efficiency"] > 0
            for base in bench.TORCH_RINGS:
                assert name == base or v[name]["time_ratio_vs " + base] > 0
        if world > 1:
            for name in (bench.OURS, bench.TORCH_A2A, bench.TORCH_AG):
                assert v[name]["comm_standalone_s"] > 0
                assert v[name]["comm_hidden_fraction"] is not None
        else:
            assert v[bench.OURS]["comm_hidden_fraction"] is None


def test_timeline_and_png(tiny_results):
    data, png, _, opts = tiny_results
    tl = data["meta"]["timeline_config"]
    assert tl["causal"] and tl["world_size"] == max(opts.world_sizes)
    (cfg,) = [c for c in data["configs"] if c["config"] == tl]
    timeline = cfg["variants"][bench.OURS]["timeline"]
    assert len(timeline) == tl["world_size"]
    for events in timeline:
        classes = {e["class"] for e in events}
        assert {"comm", "wait", "compute"} <= classes
        assert all(e["t1"] >= e["t0"] for e in events)
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_options():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    opts = bench.options_from_args(parser.parse_args(["--tiny", "--mask", "causal", "--variants", "ours eager"]))
    assert opts.world_sizes == bench.TINY["world_sizes"] and opts.causal == (True,)
    assert opts.variants == ("ours eager",)
    default = bench.options_from_args(parser.parse_args(["-C", "2,4", "-S", "1024"]))
    assert default.world_sizes == (2, 4) and default.seq_lens == (1024,) and default.repeats == 5


def test_host_time_per_step_reported_for_stubbed_variants(tiny_results):
    data, _, lines, _ = tiny_results
    for cfg in data["configs"]:
        ours = cfg["variants"][bench.OURS]
        assert math.isfinite(ours["host_s_per_step"]) and ours["host_s_per_step"] > 0, ours
        assert ours["steps_per_sample"] >= 1
        assert "host_s_per_step" not in cfg["variants"][bench.TORCH_A2A]  # no stand-ins registered for it
    assert all("host/step ours" in line for line in lines[1:])


def test_samples_average_enough_steps(ranks):
    """A short step is timed over several back-to-back runs, the same number on every rank."""
    p = bench.Problem(1, 2, 32, 128, 2, True)
    rows = ranks(
        2, bench.bench_rank, p, [bench.VARIANTS[bench.OURS], bench.VARIANTS[bench.SINGLE]], 2, "cpu", False, (), 1, 0.2
    )
    counts = {r["variants"][bench.OURS]["steps_per_sample"] for r in rows}
    assert len(counts) == 1 and counts.pop() > 1


def test_virtual_ranks_decomposition(tmp_path):
    from cp_compile.tools.bench import virtual

    rows = virtual.run(
        torch.device("cpu"),
        world_sizes=(2, 3),
        seq_lens=(96,),
        causal=(True, False),
        batch=1,
        heads=2,
        head_dim=16,
        dtype="float32",
        repeats=2,
        out=tmp_path / "v.json",
        log=lambda s: None,
    )
    assert len(rows) == 4 and json.loads((tmp_path / "v.json").read_text())["configs"] == rows
    for row in rows:
        assert len(row["per_rank"]) == row["config"]["world_size"]
        assert row["efficiency"] > 0 and row["tflops_per_rank"] > 0
        assert row["host_ms_per_step"] > 0 and row["device_ms_per_step"] > 0
    assert len(virtual.table(rows).splitlines()) == 2 + len(rows)


def test_virtual_ranks_leave_out_what_the_deadline_cannot_hold():
    """Past its deadline the decomposition measures nothing more and says so per configuration; a longer
    sequence is expected to take the square of the length ratio times the longest shorter one."""
    import time

    from cp_compile.tools.bench import virtual

    args = dict(world_sizes=(2,), seq_lens=(64, 128), causal=(True,), batch=1, heads=2, head_dim=16)
    rows = virtual.run(
        torch.device("cpu"), **args, dtype="float32", repeats=1, out=None, log=lambda s: None, deadline=time.monotonic()
    )
    assert [r["skipped"].startswith("not run") for r in rows] == [True, True]
    assert "not run" in virtual.table(rows)
    assert virtual._expected_seconds(256, {64: 1.0, 128: 2.0}) == 8.0
    assert virtual._expected_seconds(128, {64: 1.0, 128: 3.0}) == 3.0
    assert virtual._expected_seconds(64, {}) == 0.0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_virtual_rank_computes_its_share(world_size, causal):
    """The kernels the decomposition times give each rank its exact output and dq (fp64)."""
    from helpers import make_qkv, max_err, sdpa_with_grads

    from cp_compile.layout import layout_named
    from cp_compile.tools.bench import virtual

    q, k, v, do = make_qkv(1, 4, 2, 12 * world_size, 8)
    reference = sdpa_with_grads(q, k, v, do, is_causal=causal)
    shard = lambda t, r: layout_named("zigzag").shard(t, 2, r, world_size)  # noqa: E731
    kv = [(shard(k, r), shard(v, r)) for r in range(world_size)]
    for rank in range(world_size):
        out, lse = virtual.rank_forward(shard(q, rank), kv, rank, causal, 8**-0.5)
        dq, _ = virtual.rank_backward(shard(do, rank), shard(q, rank), kv, out, lse, rank, causal, 8**-0.5)
        assert max_err(out, shard(reference[0], rank)) < 1e-12
        assert max_err(dq, shard(reference[1], rank)) < 1e-12


def test_torchrun_driver_on_gloo(tmp_path):
    """The multi-GPU entry point (``torchrun ... -m cp_compile bench``), run here on CPU ranks with gloo."""
    import subprocess
    import sys

    out = tmp_path / "r.json"
    # torchrun of this interpreter (python -m torch.distributed.run), whichever torch the suite runs on
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own, not the fixed default another job may hold
        "--nproc-per-node",
        "2",
        "-m",
        "cp_compile",
        "bench",
        "--tiny",
        "--no-trace",
        "--mask",
        "causal",
        "--variants",
        "ours eager",
        "--out",
        str(out),
    ]
    res = subprocess.run(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu"
    (cfg,) = data["configs"]  # under torchrun C is the launched world size
    assert cfg["config"]["world_size"] == 2 and cfg["variants"][bench.OURS]["valid"]


EXITS_CLEANLY = """
import gc, os, sys
import torch
import torch.distributed as dist
import cp_compile

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
q = torch.randn(1, 2, 8, 4)
cp_compile.ring_attention(q, q, q, is_causal=True)  # the first op call imports torch._dynamo
dist.destroy_process_group()
gc.collect()
print(before, threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_destroyed_group_leaves_no_gloo_thread_running(tmp_path):
    """After destroy_process_group nothing holds the group, so gloo's threads are joined before the
    interpreter exits. One still running there may drop a finished collective's tensors while Python tears
    down, which aborts the process ('terminate called without an active exception')."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", EXITS_CLEANLY, f"file://{tmp_path / 'store'}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    before, after = map(int, res.stdout.split())
    assert after == before, f"{after - before} threads still run after destroy_process_group"


def profiled_steps():
    """3 steps of 2 all-gathers and a matmul each, taken apart by cp_compile.tools.breakdown. The gathers are
    256 KiB a rank, so that gloo's worker thread spends long enough copying them that counting its copies as
    compute, beside the caller's wait in the collective, would exceed the profiled time."""
    import torch

    import cp_compile
    from cp_compile.comm.gather import gather_dim0
    from cp_compile.tools.breakdown import breakdown

    plan = cp_compile.ContextParallel()
    x = torch.randn(256, 256)

    def prepare():
        def steps():
            for _ in range(3):
                y = x @ x
                for _ in range(2):
                    gather_dim0(y, plan.group_name, plan.world_size)

        return steps

    return breakdown(prepare, 3)


def test_breakdown_counts_the_collectives_of_a_step(ranks):
    for costs in ranks(2, profiled_steps):
        assert costs["collectives"] == 2 and costs["collective_ms"] > 0 and costs["compute_ms"] > 0
        assert costs["profiled_ms"] >= costs["compute_ms"] + costs["collective_ms"] - 1e-6
