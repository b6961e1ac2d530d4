"""Shared fixtures: a pool of gloo ranks per world size, alive for the whole session."""

import pytest

from cp_compile.launch import RankPool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(C, fn, *args)`` runs ``fn`` on C gloo ranks and returns per-rank results."""
    pools: dict[int, RankPool] = {}

    def run(world_size: int, fn, *args, timeout: float = 180.0, **kwargs):
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size].run(fn, *args, timeout=timeout, **kwargs)

    yield run
    for pool in pools.values():
        pool.close()
