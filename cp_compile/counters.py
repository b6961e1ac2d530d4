"""What this process did inside a ``with`` block, eager or compiled: the ring transfers it sent
(``count_traffic``) and the FlexAttention chunk pairs it computed and skipped (``count_blocks``). The ops add
to every count open at the time they run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class Traffic:
    shifts: int = 0  # ring_shift calls
    tensors_sent: int = 0
    bytes_sent: int = 0
    by_tag: dict = field(default_factory=dict)  # tag -> number of shifts


_active_traffic: list[Traffic] = []


@contextlib.contextmanager
def open_count(active: list, count):
    """``count`` kept in ``active`` (what this process's ops add to) for the block; yields it."""
    active.append(count)
    try:
        yield count
    finally:
        active.remove(count)


def count_traffic() -> contextlib.AbstractContextManager[Traffic]:
    """Count ring transfers issued by this process inside the block."""
    return open_count(_active_traffic, Traffic())


def record_shift(tensors: list[Tensor], tag: int) -> None:
    for t in _active_traffic:
        t.shifts += 1
        t.tensors_sent += len(tensors)
        t.bytes_sent += sum(x.numel() * x.element_size() for x in tensors)
        t.by_tag[tag] = t.by_tag.get(tag, 0) + 1


@dataclass
class BlockCount:
    computed: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    skipped: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})


_active_counts: list[BlockCount] = []


def count_blocks() -> contextlib.AbstractContextManager[BlockCount]:
    """Count (query chunk, key chunk) pairs this process computes and skips inside the block."""
    return open_count(_active_counts, BlockCount())


def record_blocks(direction: str, computed: int, skipped: int) -> None:
    for c in _active_counts:
        c.computed[direction] += computed
        c.skipped[direction] += skipped
