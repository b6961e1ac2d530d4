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
    "test_house.py",
    "test_ring.py",
    "test_variants.py",
    "test_allgather.py",
}


# ``pytest -m core tests``, what CI runs on the oldest torch it supports (2.11, the torch of the GPU images seen so
# far): the quick tier, the compiled paths (plain models, Hugging Face models) and the GPU tier with its check's dry
# run on the CPU.
CORE_MODULES = QUICK_MODULES | {"test_compile.py", "test_hf.py", "test_cuda.py", "test_gpu_check.py"}


# The sweeps over transformers' families, one model after another through each family's own modeling code: CI runs
# them on the first torch only (marked ``families``); the torch they exercise (the ops, the hooks, the compiled paths)
# the rest of the suite covers on every release.
FAMILY_MODULES = {
    "test_models.py",
    "test_hf_families.py",
    "test_hf_hybrids.py",
    "test_own_attention.py",
    "test_hf_indexed.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in FAMILY_MODULES:
            item.add_marker(pytest.mark.families)
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
        if item.path.name in CORE_MODULES:
            item.add_marker(pytest.mark.core)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The errors a test measured against the error rule go with its report (``user_properties``)."""
    from helpers import MEASURED_ERRORS

    MEASURED_ERRORS.clear()
    try:
        return (yield)
    finally:
        item.user_properties.extend(("error", measured) for measured in MEASURED_ERRORS)


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
