"""Shared fixtures: a pool of gloo ranks per world size, alive for the whole session."""

import pytest

from cp_compile.launch import RankPool


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
