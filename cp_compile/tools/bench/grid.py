"""What the benchmarks of one layer over lengths and CP degrees share: their options, a timing, the loop over pools
of local gloo ranks."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from ..breakdown import wall_time


def add_arguments(p: argparse.ArgumentParser, defaults: dict) -> None:
    p.add_argument("--lengths", default=defaults["lengths"], help="comma list of global sequence lengths")
    p.add_argument("--world-sizes", "-C", default=defaults["world_sizes"], help="comma list of C")
    p.add_argument("--repeats", type=int, default=defaults["repeats"])
    p.add_argument("--out", type=Path, default=None, help="JSON with every row")


def lengths_and_sizes(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    return [int(x) for x in args.lengths.split(",")], [int(x) for x in args.world_sizes.split(",")]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` runs of ``fn()``, after one run that warms up."""
    return statistics.median([wall_time(fn) for _ in range(repeats + 1)][1:])


def on_rank_pools(
    sizes: list[int], lengths: list[int], per_rank: Callable, repeats: int, timeout: float
) -> Iterator[tuple[int, int, list]]:
    """``(C, length, every rank's per_rank(length, repeats))`` for each C and length, on one pool of C local gloo
    ranks per C."""
    from ..launch import RankPool

    for c in sizes:
        with RankPool(c) as pool:
            for n in lengths:
                yield c, n, pool.run(per_rank, n, repeats, timeout=timeout)


__all__ = ["add_arguments", "lengths_and_sizes", "median_seconds", "on_rank_pools"]
