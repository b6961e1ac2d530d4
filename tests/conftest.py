"""Shared fixtures (a pool of gloo ranks per world size, alive for the whole session) and the quick tier."""

import pytest

from cp_compile.tools.launch import RankPool

# ``pytest -m quick tests``, the loop while editing (under 2 minutes here): the kernels against dense fp64,
# graph shapes on the fake group, the layer rule, the cost model, the layouts, every schedule and kind run
# eagerly on gloo ranks at C = 1 to 4 against one device, and the all-gather schedule compiled. The whole
# suite (compilation, models, integrations, docs) runs in CI.
QUICK_MODULES = {
    "test_block.py",
    "test_graph.py",
    "test_layers.py",
    "test_cost.py",
    "test_layout.py",
    "test_kinds.py",
    "test_ring.py",
    "test_variants.py",
    "test_allgather.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    """``ranks(C, fn, *args)`` runs ``fn`` on C gloo ranks and returns per-rank results.

    All pools share one Inductor cache directory, so a kernel compiled for one
    world size is not compiled again for another.
    """
    pools: dict[int, RankPool] = {}
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor_cache"))}

    def run(world_size: int, fn, *args, timeout: float = 180.0, **kwargs):
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, env=env)
        return pools[world_size].run(fn, *args, timeout=timeout, **kwargs)

    def restart(world_size: int) -> None:
        """Kill the pool of ``world_size``: the next call starts fresh ranks (after a case that may have left the
        process group broken, a collective timed out or a rank waiting)."""
        if world_size in pools:
            pools.pop(world_size).close(force=True)

    run.restart = restart
    yield run
    for pool in pools.values():
        pool.close()


@pytest.fixture
def fake_plan():
    """A plan over a fake 2-rank process group: enough to trace and compile, values are not checked."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cp_compile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield cp_compile.ContextParallel()
    dist.destroy_process_group()
