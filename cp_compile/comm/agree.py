"""Cross-rank agreement on the arguments of one call.

``cp::agree`` makes every rank check every rank's q/k/v shapes and options
before the first transfer (``cp::agree_tensors`` a call's own tensors,
``cp::agree_cu_seqlens`` packed documents), so a mismatch raises the same
error everywhere instead of leaving some ranks waiting in a collective.

The ops talk to other ranks, so they are registered side-effectful: the compiler must never drop or duplicate them
on one rank only.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from ..layout.packed import check_cu_seqlens
from ..torch_compat import all_gather_single
from .groups import resolve_group

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_PER_TENSOR = 6  # ndim, the first 4 dims, dtype
_DESC_LEN = 3 * _PER_TENSOR + 2  # then device type, options crc


# The options of a rank that refused a call before its first collective (``refuse_together``): its row then
# differs from every rank that did not, and the agreement names the refusing ranks.
REFUSED = "\0refused"


def _describe(tensors: list[Tensor], options: str) -> list[int]:
    desc: list[int] = []
    for t in tensors:
        dims = list(t.shape)[:4]
        desc += [t.dim()] + dims + [-1] * (4 - len(dims))
        desc.append(_DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1)
    desc.append(0 if tensors[0].device.type == "cpu" else 1)
    desc.append(-1 if options == REFUSED else zlib.crc32(options.encode()))
    return desc


def _fmt(row: list[int], names) -> str:
    described = []
    for i, name in enumerate(names):
        ndim, *dims, dtype = row[_PER_TENSOR * i : _PER_TENSOR * (i + 1)]
        shape = str(tuple(dims[: min(max(ndim, 0), 4)])) if ndim <= 4 else f"<{ndim}-D>"
        described.append(f"{name}{shape} {_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else 'unsupported dtype'}")
    return ", ".join(described)


def check_agreement(rows: list[list[int]], what: str, names=("q", "k", "v")) -> None:
    """Raise the same error on every rank if the ranks' descriptors differ.

    Every rank runs this on the same gathered data, so every rank reaches the
    same verdict and the same message.
    """
    first = rows[0]
    bad = [r for r, row in enumerate(rows) if row != first]
    if not bad:
        return
    refused = [r for r, row in enumerate(rows) if row[-1] == -1]
    if refused:
        others = ", the others did not" if len(refused) < len(rows) else " (with different inputs)"
        raise ValueError(
            f"{what}: ranks {refused} refused this call before its first transfer{others}: those ranks' errors "
            "say why (every rank must pass the same shapes, dtypes and options)"
        )
    detail = "; ".join(f"rank {r}: {_fmt(row, names)}" for r, row in enumerate(rows))
    if any(row[-1] != first[-1] for row in rows):
        detail += (
            "; the ranks also passed different options (compiled: or a later attention site of the graph "
            "differs, which this first agreement of the graph covers)"
        )
    if any(row[-2] != first[-2] for row in rows):
        detail += "; the ranks hold tensors on different device types"
    raise ValueError(
        f"{what}: ranks disagree on their inputs ({detail}). Every rank must pass the same shapes, dtypes and options."
    )


def refuse_together(error: Exception, q, k, v, group_name: str) -> None:
    """Raise ``error``, a check's verdict on this rank's call before the call's first collective, on every rank
    of the group: a rank that raised alone would leave the others waiting in the schedule's first collective.

    Only the refusing ranks run this: it is the agreement the other ranks' schedule opens with, with a row
    that cannot match theirs, so every rank raises there, the refusing ranks their own error after it. Where
    every rank refused, the rows match and each raises its own."""
    group = resolve_group(group_name)
    if group.size() > 1:
        tensors = [t if isinstance(t, Tensor) else torch.empty(0) for t in (q, k, v)]
        try:
            torch.ops.cp.agree(*tensors, group_name, REFUSED)
        except ValueError as disagreement:
            raise ValueError(f"{disagreement}. This rank's error: {type(error).__name__}: {error}") from error
    raise error


def every_rank(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (as many on every rank), in rank order: one small all-gather and a host read,
    the step every agreement is made of (gloo groups exchange on the CPU)."""
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = torch.empty(group.size() * len(values), dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    return everyone.view(group.size(), len(values)).tolist()


@torch.library.custom_op("cp::agree", mutates_args=())
def agree(q: Tensor, k: Tensor, v: Tensor, group_name: str, options: str) -> None:
    """All-gather a small descriptor of (q, k, v, options); raise if ranks differ.

    A token mixer's call (``cp_compile.mixers``) agrees through it too, its options starting with
    ``mixer=<name>``: the compiler then folds every agreement of a graph alike."""
    rows = every_rank(_describe([q, k, v], options), resolve_group(group_name), q.device)
    if options.startswith("mixer="):
        check_agreement(rows, f"cp_compile {options.split()[0][6:]}", ("input 1 ", "input 2 ", "input 3 "))
    else:
        check_agreement(rows, "cp_compile attention")


@agree.register_fake
def _(q, k, v, group_name, options):
    return None


@torch.library.custom_op("cp::agree_tensors", mutates_args=())
def agree_tensors(tensors: list[Tensor], group_name: str, what: str) -> None:
    """Every rank holds the same ``tensors`` (shapes, dtypes and contents: a digest of each, read on the host),
    or every rank raises the same ValueError naming ``what``. For small tensors that steer a call, such as a
    sharded BlockMask's tables: ranks that read different ones would run different work."""
    digests = [
        zlib.crc32(repr((tuple(t.shape), str(t.dtype))).encode() + t.detach().contiguous().cpu().numpy().tobytes())
        for t in tensors
    ]
    group = resolve_group(group_name)
    device = tensors[0].device if tensors else torch.device("cpu")
    rows = every_rank([len(tensors), zlib.crc32(str(digests).encode())], group, device)
    if any(row != rows[0] for row in rows):
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        raise ValueError(
            f"cp_compile attention: ranks disagree on the {what}: ranks {differ} hold another one than rank 0 "
            "(another mask, or one sharded for another length). Every rank passes its own shard of the same one"
        )


@agree_tensors.register_fake
def _(tensors, group_name, what):
    return None


@torch.library.custom_op("cp::agree_cu_seqlens", mutates_args=())
def agree_cu_seqlens(cu_seqlens: Tensor, group_name: str) -> None:
    """All-gather a digest of cu_seqlens; raise on every rank if the ranks passed different ones.

    Validation comes after the exchange: a rank that raised first would leave
    the others waiting in the collective.
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    mine = [zlib.crc32(str(cu).encode()), len(cu), cu[-1] if cu else -1]
    rows = every_rank(mine, resolve_group(group_name), cu_seqlens.device)
    if any(row != rows[0] for row in rows):
        detail = "; ".join(f"rank {r}: {n - 1} documents, {total} tokens" for r, (_, n, total) in enumerate(rows))
        raise ValueError(f"cu_seqlens differs across ranks ({detail}); pass the same global cu_seqlens on every rank")
    check_cu_seqlens(cu)


@agree_cu_seqlens.register_fake
def _(cu_seqlens, group_name):
    return None


for _op in (torch.ops.cp.agree.default, torch.ops.cp.agree_tensors.default, torch.ops.cp.agree_cu_seqlens.default):
    torch.fx.node.has_side_effect(_op)
