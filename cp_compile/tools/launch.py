"""A pool of local ranks (one process each, gloo on CPU) that stays alive.

Spawning a process and importing torch costs seconds, so the demo, the
benchmarks and the test suite start C workers once and send them functions.
Each call runs ``fn(*args, **kwargs)`` on every rank with the process group
already initialised and returns the per-rank results in rank order.

``RankPool(C, init_group=False)`` starts the workers as ``torchrun`` starts a
script instead: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT are set, and no process group exists until the code sent
creates one (the documentation's examples run that way).

For ranks that ``torchrun`` started, ``torchrun_group`` joins (and leaves) the
launched group and ``torchrun_runner`` runs a function the same way a pool does.

A call that does not finish in time (a rank stuck in a collective) tears the
pool down and raises ``TimeoutError``; the next call starts a fresh pool. An
exception on any rank is re-raised here with every failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        super().__init__(
            f"ranks {sorted(errors)} raised:\n"
            + "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, _, tb) in sorted(errors.items()))
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(rank: int, world_size: int, threads: int) -> None:
    """Keep rank ``rank`` on cores of its own where every rank can have its own: a rank that migrates or
    shares a core with a peer waits on the scheduler inside each collective (on 2 cores, a 256-token
    training step at C=2 took 33 ms unpinned and 25 ms pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    if world_size * threads <= len(cores):
        os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tasks,
    results,
    threads: int,
    pg_timeout: float,
    env: dict[str, str],
    init_group: bool,
    pin: bool,
) -> None:
    if pin:
        _pin(rank, world_size, threads)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if init_group:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    else:  # what torchrun sets for a script
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    import cp_compile  # noqa: F401  (register the ops once per worker)

    results.put(("ready", rank, True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            # the queue pickles in a background thread and drops what it cannot pickle (e.g. a SymInt),
            # which would leave the caller waiting: fail here, with the reason, instead
            pickle.dumps(value)
            results.put((task_id, rank, True, value))
        except BaseException as e:  # noqa: BLE001  (reported to the caller)
            results.put((task_id, rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world_size`` local gloo ranks, reusable across calls."""

    def __init__(
        self,
        world_size: int,
        threads_per_rank: int = 1,
        pg_timeout: float = 60.0,
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        init_group: bool = True,
        pin: bool = False,
    ):
        self.world_size = world_size
        self.pin = pin  # each rank on cores of its own, where the machine has enough (benchmarks)
        self.init_group = init_group
        self.env = dict(env or {})  # set in each worker before anything runs
        self.threads_per_rank = threads_per_rank
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self._ids = itertools.count()
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self._tasks[r],
                    self._results,
                    self.threads_per_rank,
                    self.pg_timeout,
                    self.env,
                    self.init_group,
                    self.pin,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", self.start_timeout)

    def _collect(self, task_id, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            try:
                tid, rank, ok, value = self._results.get(timeout=max(0.0, min(remaining, 1.0)))
            except queue.Empty:
                if dead or remaining <= 0:
                    self.close(force=True)
                    why = f"ranks {dead} died" if dead else f"timed out after {timeout:.0f}s"
                    msg = f"{why}; ranks {sorted(set(values) | set(errors))} had finished"
                    if errors:
                        raise TimeoutError(f"{msg}. Errors so far:\n{RankError(errors)}") from None
                    raise TimeoutError(msg) from None
                continue
            if tid != task_id:
                continue  # a late answer to a call that already failed
            (values if ok else errors)[rank] = value
        if errors:
            raise RankError(errors)
        return [values[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout: float = 180.0, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close(force=True)
            self._start()
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        return self._collect(task_id, timeout)

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalPools:
    """One ``RankPool`` per world size (gloo, CPU), created on first use."""

    def __init__(self, threads_per_rank: int = 1):
        self.threads_per_rank = threads_per_rank
        self.pools: dict = {}

    def __call__(self, world_size: int, fn, *args, timeout: float = 1800.0, **kwargs):
        if world_size not in self.pools:
            self.pools[world_size] = RankPool(world_size, threads_per_rank=self.threads_per_rank)
        return self.pools[world_size].run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def launched_by_torchrun() -> bool:
    """Whether this process is a rank that ``torchrun`` started (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def torchrun_group() -> Iterator[bool]:
    """This torchrun rank in its process group for the block: NCCL on its GPU (LOCAL_RANK), gloo on CPU; yields
    whether on CUDA. Every rank leaves the group when its block ends; not after an error, when a peer may still
    be inside a collective and leaving would hang."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    yield cuda
    dist.destroy_process_group()


def torchrun_runner(world_size: int, fn, *args, timeout: float = 0.0, **kwargs):
    """Run on this already-launched rank (torchrun), gather every rank's result."""
    import torch.distributed as dist

    if world_size != dist.get_world_size():
        raise ValueError(f"under torchrun C is the launched world size ({dist.get_world_size()}), not {world_size}")
    rows = [None] * world_size
    dist.all_gather_object(rows, fn(*args, **kwargs))
    return rows
