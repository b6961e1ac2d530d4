"""The benchmark end to end on the session's gloo rank pools (tiny configuration)."""

import json
import math

import pytest
import torch

from cp_compile import bench


def plugin_setup(problem, inputs):
    """A variant registered from outside bench.py: ours again, under another name."""
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
        kinds = {e["kind"] for e in events}
        assert {"comm", "wait", "compute"} <= kinds
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
