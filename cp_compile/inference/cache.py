"""A KV cache sharded over the ranks of a plan: each rank holds 1/C of every layer's keys and values.

A prompt sharded with the plan's packed layout (``prefill``) leaves each rank
the K/V of its own tokens. Tokens added later (``append``: decoding, drafts,
a follow-up prompt) are computed on every rank, and each is kept by one rank,
round robin over positions, so the shares stay within a token or two of each
other. Every slot carries the global position of its token: attention
(the ``cp::cached_attention`` schedule) masks by position, so slots need no
order and a sliding window is a position test.

A layer with a sliding window keeps only what a later query can see, in a
ring of ``ceil(window / C) + 1`` slots per rank where a token overwrites one
that every later query has left behind: its size does not grow with the
sequence, and it is about 1/C of one process's window. The prompt's last
window is computed by whichever ranks the packed layout gave it to, so the
prefill gathers those tokens once (one all-gather per window layer) and
deals them round robin like appended tokens.

Storage is preallocated (one more slot as a scratch slot, where a rank writes
the tokens other ranks keep), and every per-step quantity (positions, the slot
of a new token, the owner rank) is a tensor: a compiled decode step has
static shapes and holds neither the rank nor the step, so one graph serves
every token.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..comm.gather import gather_dim0
from ..kernels.block import block_attn_impl
from ..kernels.masked import EMPTY_POSITION, every_key_attn, positions_visible, visible_attn
from ..kernels.merge import acc_dtype
from ..kernels.sparse import picked_attention, picks_in_slots
from .cached import CachedSettings, cached_attention, merge_over_ranks, payload_numel


def capacity_for(max_tokens: int, world_size: int) -> int:
    """Slots per rank that hold ``max_tokens`` however they split into a prefill and appends: the packed
    layout pads the prompt to 2C chunks (at most 2 slots more than P/C), round robin adds at most one."""
    return max_tokens // world_size + 3


# token ids enter the digest modulo 2**24: every id below it is exact in fp32, the dtype the tag travels in
_DIGEST = 2**24
_IN_STEP, _FINAL = 0, 1
TAG_NUMEL = 2  # an Agreement's tag: [marker, digest]
_PLAIN = CachedSettings()  # attention without a chunk or a soft-cap


class Agreement:
    """Whether every rank decodes the same tokens, checked at no collective of its own.

    Ranks that drew different tokens (sampling seeded differently) or stop at different steps would
    go on to call different collectives. ``note`` keeps a digest of a step's tokens, and the first
    layer of the next step sends it, as the tag of ``cp::cached_attention``, in the gather that the
    step makes anyway. Every rank receives every rank's tag, so ``differs`` turns true on every rank
    at the same step; a generation that stops when it does stops on every rank at once. ``finish``
    then tells every rank, once per generation, whether they differed.

    A rank that stops while another goes on (it drew the end-of-sequence token and the other did not,
    or a stopping rule of its own fired) meets the other's next first-layer gather in ``finish``: it
    sends a payload of that gather's size marked final, so the other learns at once that they differ,
    joins the gathers of that step's remaining layers, then the other's ``finish``. No rank is left
    waiting in a collective.
    """

    def __init__(self, group_name: str, world_size: int):
        self.group_name, self.world_size = group_name, world_size
        self.tokens = torch.zeros((), dtype=torch.int64)  # digest of the tokens this rank drew last
        self.differs = torch.zeros((), dtype=torch.bool)
        self.per_query: dict[int, int] = {}  # layer -> elements it gathers from each rank for one query token
        self.dtype = torch.float32

    def to(self, device: torch.device) -> None:
        self.tokens, self.differs = self.tokens.to(device), self.differs.to(device)

    def note(self, tokens: Tensor) -> None:
        """This rank drew ``tokens`` (``[B]``) at the step just run; no collective, no host read."""
        flat = tokens.flatten().long()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device)
        self.tokens.copy_(((flat % _DIGEST) * weights).sum() % _DIGEST)

    def tag(self, dtype: torch.dtype, marker: int = _IN_STEP) -> Tensor:
        """``[marker, digest]`` in ``dtype``: sent by the first layer of a step, or by ``finish`` marked final."""
        self.dtype = dtype  # what finish sends in, as the layers' gathers do
        return torch.stack([torch.full_like(self.tokens, marker), self.tokens]).to(dtype)

    def record(self, layer: int, tags: Tensor, per_query: int) -> None:
        """Every rank's tag as a layer's gather returned it (``[C, n]``; n = 0 for a layer without one)."""
        if not torch.compiler.is_compiling():
            # the same for every step of a layer (one query's payload), kept by the eager ones (a generation's first
            # step is eager): a compiled step then writes no Python state, and its graph reads none
            self.per_query[layer] = per_query
        if tags.shape[1]:
            self._compare(tags)

    def _compare(self, tags: Tensor) -> None:
        self.differs.logical_or_((tags != tags[:1]).any())

    def reset(self) -> None:
        self.tokens.zero_()
        self.differs.zero_()

    def finish(self) -> bool:
        """Collective, after a generation's last step on this rank: True when the ranks drew different tokens
        or stopped at different steps (the same answer on every rank)."""
        if self.world_size > 1 and self.per_query:
            first, *rest = sorted(self.per_query)
            final = torch.cat(
                [self.tokens.new_zeros(self.per_query[first], dtype=self.dtype), self.tag(self.dtype, _FINAL)]
            )
            tags = self._final(final)
            if bool((tags[:, 0] != _FINAL).any()):  # a rank is in its next step: join it to its own finish
                for layer in rest:  # that step's other layers: their payloads carry no tag
                    gather_dim0(final.new_zeros(1, self.per_query[layer]), self.group_name, self.world_size)
                self._final(final)
        return bool(self.differs)

    def _final(self, payload: Tensor) -> Tensor:
        """Every rank's tag from a gather of ``payload``, whose end is this rank's final tag; compared."""
        tags = gather_dim0(payload[None], self.group_name, self.world_size)[:, -TAG_NUMEL:]
        self._compare(tags)
        return tags


class Step(NamedTuple):
    """What attention of the tokens just appended reads: keys, values and their positions on this rank,
    and the positions of the new tokens (the queries)."""

    keys: Tensor
    values: Tensor
    key_positions: Tensor
    query_positions: Tensor


class CacheShard:
    """This rank's share of one attention layer's KV cache, for sequences of at most ``max_tokens``;
    ``window`` (transformers' ``sliding_window``: a key is visible when ``q - k < window``) bounds it.

    Buffers are allocated by the first write (dtype, heads and device are the model's).
    """

    def __init__(self, group_name: str, rank: int, world_size: int, max_tokens: int, window: Optional[int] = None):
        self.group_name, self.world_size, self.max_tokens = group_name, world_size, max_tokens
        self.capacity = capacity_for(max_tokens, world_size)
        self.window = window
        self.ring = None  # slots of the window ring: every slot of the layer, when the window bounds it
        if window is not None and math.ceil(window / world_size) + 1 < self.capacity:
            self.ring = self.capacity = math.ceil(window / world_size) + 1
        self.keys: Optional[Tensor] = None
        self.values: Optional[Tensor] = None
        self.positions = torch.full((self.capacity + 1,), EMPTY_POSITION, dtype=torch.int64)
        self._rank = torch.tensor(rank)
        self.seen = torch.zeros((), dtype=torch.int64)  # tokens of the sequence stored so far, over all ranks
        # ``seen`` as a Python int, kept by eager steps so that they check capacity without reading the device;
        # None after a compiled step (it cannot keep an int without a recompile per value): read once then
        self.host_seen: Optional[int] = 0
        self._append_start = torch.zeros((), dtype=torch.int64)  # first position kept round robin
        self._append_slot = torch.zeros((), dtype=torch.int64)  # this rank's slot for its first such token
        # the two above as Python ints (no step changes them): with ``host_seen``, an eager step knows which
        # slots hold tokens without reading the device
        self.host_append = (0, 0)
        self.host_rank = rank
        self.agreement: Optional[Agreement] = None  # the first layer of a cache sends its tag
        self.index = 0  # the layer's place in its cache

    def _allocate(self, k: Tensor, v: Tensor) -> None:
        batch, heads = k.shape[:2]
        self.keys = k.new_zeros(batch, heads, self.capacity + 1, k.shape[-1])
        self.values = v.new_zeros(batch, heads, self.capacity + 1, v.shape[-1])
        for name in ("positions", "_rank", "seen", "_append_start", "_append_slot"):
            setattr(self, name, getattr(self, name).to(k.device))
        if self.agreement is not None:
            self.agreement.to(k.device)
        if not torch.compiler.is_compiling():
            # written in place by every step: at fixed addresses, a compiled step can be captured as a CUDA graph
            for t in (
                self.keys,
                self.values,
                self.positions,
                self.seen,
                self._append_start,
                self._append_slot,
                *(() if self.agreement is None else (self.agreement.tokens, self.agreement.differs)),
            ):
                torch._dynamo.mark_static_address(t)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds for the layer."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def prefill(self, k: Tensor, v: Tensor, positions: Tensor, tokens: int) -> None:
        """Store this rank's slots ``[B, Hkv, L_local, D]`` of a prompt of ``tokens`` tokens sharded by the
        packed layout; ``positions [L_local]`` is each slot's position, ``EMPTY_POSITION`` for padding."""
        if self.keys is None:
            self._allocate(k, v)
        if self.stored():
            raise ValueError("a sharded prefill fills an empty cache; run a follow-up prompt as a multi-token step")
        if tokens > self.max_tokens:
            raise ValueError(f"a {tokens}-token prompt does not fit a cache of {self.max_tokens} tokens")
        if k.dim() != 4 or k.shape[2] != positions.shape[0] or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"the sharded prefill stores keys {tuple(k.shape)} and values {tuple(v.shape)}, but this rank holds "
                f"{positions.shape[0]} slots of the prompt: the model does not hand the cache [batch, heads, tokens, "
                "dim] keys and values of its shard (a model with attention code of its own)"
            )
        self.seen.fill_(tokens)
        self.host_seen = tokens
        if self.ring is not None:
            self._deal_last_window(k, v, positions.to(self.positions.device), tokens)
            return
        # the tokens alone, padding left out, from slot 0 on: the slots that hold tokens are a prefix
        # (``written``), which an eager decode step reads without a mask
        real = (positions != EMPTY_POSITION).nonzero().flatten()  # the caller's positions are on the host
        slots = real.numel()
        if slots and int(real[-1]) == slots - 1:  # a prefix already (the packed layout pads at the end): copies
            self.keys[:, :, :slots] = k[:, :, :slots]
            self.values[:, :, :slots] = v[:, :, :slots]
            self.positions[:slots] = positions[:slots]
        else:
            real = real.to(k.device)
            self.keys[:, :, :slots] = k.index_select(2, real)
            self.values[:, :, :slots] = v.index_select(2, real)
            self.positions[:slots] = positions.to(self.positions.device).index_select(0, real)
        self._append_start.fill_(tokens)
        self._append_slot.fill_(slots)
        self.host_append = (tokens, slots)

    def _deal_last_window(self, k: Tensor, v: Tensor, positions: Tensor, tokens: int) -> None:
        """The prompt's tokens a later query can see (the first, at ``tokens``, sees back to
        ``tokens - window + 1``), from every rank, dealt round robin into the ring as if appended.
        Collective: one all-gather of at most ``window - 1`` slots per rank."""
        first = max(0, tokens - self.window + 1)
        self._append_start.fill_(first)
        self._append_slot.fill_(0)
        self.host_append = (first, 0)
        most = min(self.window - 1, k.shape[2])  # what one rank can hold of the last window
        if most == 0:
            return
        kept = ((positions != EMPTY_POSITION) & (positions >= first)).nonzero().flatten()
        slots = torch.zeros(most, dtype=torch.int64, device=k.device)
        slots[: kept.numel()] = kept
        held = torch.full((most,), EMPTY_POSITION, dtype=torch.int64, device=k.device)
        held[: kept.numel()] = positions[kept]
        kv = torch.cat([k, v.to(k.dtype)], dim=-1).index_select(2, slots)
        gathered, gathered_positions = self._every_rank_slots(kv, held, 2)
        turn = gathered_positions - first
        mine = (gathered_positions != EMPTY_POSITION) & (turn % self.world_size == self._rank)
        self._write(
            gathered[..., : k.shape[-1]],
            gathered[..., k.shape[-1] :],
            gathered_positions,
            mine,
            (turn // self.world_size) % self.ring,
        )

    def append(self, k: Tensor, v: Tensor) -> Step:
        """Add the next ``L`` tokens (``[B, Hkv, L, D]``, the same on every rank); returns what their attention
        reads. Token p goes to rank ``(p - start) % C``; the others write it to the scratch slot, which stays
        empty. All tensor arithmetic: the same ops on every rank, no host sync when compiled.
        """
        if self.keys is None:
            self._allocate(k, v)
        if torch.compiler.is_compiling():
            self.host_seen = None
        else:
            stored = self.stored()
            if stored + k.shape[2] > self.max_tokens:
                raise ValueError(
                    f"the cache holds {self.max_tokens} tokens; {stored} are stored and "
                    f"{k.shape[2]} more arrived (make the cache for the generation's max_length)"
                )
            self.host_seen = stored + k.shape[2]
            if self.ring is None:
                return self._append_known(k, v, stored)
        new = self.seen + torch.arange(k.shape[2], device=self.seen.device)
        turn = new - self._append_start
        mine = turn % self.world_size == self._rank
        self.seen.add_(k.shape[2])
        if self.ring is None:
            self._write(k, v, new, mine, self._append_slot + turn // self.world_size)
            return Step(self.keys, self.values, self.positions, new)
        # The ring is read before it is written: a step longer than the ring still sees its own early tokens
        # (each counted on its owner only), and only its last tokens, the ones a later query can see, are kept.
        step = Step(
            torch.cat([self.keys, k.to(self.keys.dtype)], 2),
            torch.cat([self.values, v.to(self.values.dtype)], 2),
            torch.cat([self.positions, torch.where(mine, new, EMPTY_POSITION)]),
            new,
        )
        last = slice(max(0, k.shape[2] - self.ring * self.world_size), None)
        self._write(
            k[:, :, last],
            v[:, :, last],
            new[last],
            mine[last],
            self._append_slot + (turn[last] // self.world_size) % self.ring,
        )
        return step

    def _append_known(self, k: Tensor, v: Tensor, stored: int) -> Step:
        """``append`` where the host knows the count (eager steps): this rank's tokens copied into their slots,
        the same slots and positions as the tensor arithmetic gives, in a third of the calls."""
        length, world_size = k.shape[2], self.world_size
        new = torch.arange(stored, stored + length, device=self.seen.device)
        self.seen.add_(length)
        start, first_slot = self.host_append
        first = (self.host_rank - (stored - start)) % world_size  # the step's first token this rank keeps
        kept = len(range(first, length, world_size))
        if kept:
            slot = first_slot + (stored - start + first) // world_size
            mine = slice(first, None, world_size)
            self.keys[:, :, slot : slot + kept] = k[:, :, mine]
            self.values[:, :, slot : slot + kept] = v[:, :, mine]
            self.positions[slot : slot + kept] = new[mine]
        return Step(self.keys, self.values, self.positions, new)

    def written(self) -> Optional[int]:
        """Eagerly, the slots ``[0, n)`` of this rank that hold tokens (every one of them; a read of the device
        only after a compiled step); None for a window's ring, whose slots are overwritten in turn."""
        if self.ring is not None:
            return None
        start, first_slot = self.host_append
        turns = self.stored() - start  # appended tokens, dealt round robin from this rank's turn on
        return first_slot + max(0, (turns - self.host_rank + self.world_size - 1) // self.world_size)

    def stored(self) -> int:
        """Tokens of the sequence stored so far, over all ranks (a device read only after a compiled step)."""
        if self.host_seen is None:
            self.host_seen = int(self.seen)
        return self.host_seen

    def _write(self, k: Tensor, v: Tensor, positions: Tensor, mine: Tensor, slot: Tensor) -> None:
        slot = torch.where(mine, slot, self.capacity)
        self.keys.index_copy_(2, slot, k.to(self.keys.dtype))
        self.values.index_copy_(2, slot, v.to(self.values.dtype))
        self.positions.index_copy_(0, slot, torch.where(mine, positions, EMPTY_POSITION))

    def attend(
        self,
        q: Tensor,
        step: Step,
        scale: float,
        settings: CachedSettings = _PLAIN,
        picked: Optional[Tensor] = None,
        index: Optional[int] = None,
        left: Optional[int] = None,
    ) -> tuple[Tensor, Tensor]:
        """(out, lse) of ``q`` (the same on every rank, at ``step.query_positions``) over every rank's share;
        ``settings``: its chunk and soft-cap; ``picked [B, Lq, k]``: the tokens each query reads, by
        their place in the sequence (a sparse-attention indexer's choice), or None for every one it may see; ``index``:
        the layer whose attention this is, when not this one's (a layer attending to another's K/V); ``left``: how far
        back from its own position a query sees (-1: every key), None for the layer's window."""
        if left is None:
            left = -1 if self.window is None else self.window - 1
        compiling = torch.compiler.is_compiling()
        if compiling and self.world_size == 1 and settings == _PLAIN and picked is None:
            # one rank holds every slot: one process's attention over a static cache, which the compiler lowers with
            # the step around it (a query always sees its own slot, written before it attends)
            visible = positions_visible(step.query_positions, step.key_positions, left)
            return visible_attn(q, step.keys, step.values, visible, scale)
        written = None if compiling or settings != _PLAIN or picked is not None else self.written()
        if picked is not None:
            slots = picks_in_slots(picked, step.query_positions, step.key_positions, self.max_tokens)
            out, lse = picked_attention(q, step.keys, step.values, *slots, scale)
            return self.merge(q, out, lse, index)
        if written and (left < 0 or left + 1 >= self.max_tokens) and q.shape[2] == 1:
            # one token after every stored one, no window or chunk: it sees every slot written so far
            # (a compiled step reads the whole preallocated cache by position, as a static cache does)
            out, lse = every_key_attn(q, step.keys[:, :, :written], step.values[:, :, :written], scale)
            if self.world_size == 1:
                return out.to(q.dtype), lse
            return self.merge(q, out, lse, index)
        if written and left < 0 and self.world_size == 1:
            # several tokens after every stored one on a rank that holds them all, slot i at position i: each sees
            # the slots up to its own, the causal mask anchored at the last slot (a prompt run as one step)
            out, lse = block_attn_impl(
                q, step.keys[:, :, :written], step.values[:, :, :written], "causal_bottom_right", scale
            )
            return out.to(q.dtype), lse
        attention = torch.ops.cp.cached_attention if compiling else cached_attention
        out, lse, tags = attention(
            q,
            step.keys,
            step.values,
            step.query_positions,
            step.key_positions,
            self.group_name,
            left,
            scale,
            settings.encode(),
            self._tag(q),
        )
        self._record(q, out, tags, index)
        return out, lse

    def merge(self, q: Tensor, out: Tensor, lse: Tensor, index: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """``attend``'s (out, lse) from this rank's, of ``q`` over its own share (attention that scores the cache's keys
        in code of its own): one all-gather, which carries the agreement's tag as ``attend``'s does."""
        out, lse, tags = merge_over_ranks(q, out, lse, self.group_name, self.world_size, self._tag(q))
        self._record(q, out, tags, index)
        return out, lse

    def every_rank_keys(self, per_slot: Tensor, key_positions: Tensor, first: int, tokens: int, fill) -> Tensor:
        """``per_slot [..., S]``, a value for each slot of this rank's step (``Step.key_positions [S]``), as ``[...,
        tokens - first]``: every rank's from position ``first`` on, each at its token's place, ``fill`` where no rank
        holds one. Collective: one all-gather of the values and their positions, as bytes."""
        values, positions = self._every_rank_slots(per_slot, key_positions, per_slot.dim() - 1)
        held = ((positions >= first) & (positions < tokens)).nonzero().flatten()
        whole = per_slot.new_full((*per_slot.shape[:-1], tokens - first), fill)
        return whole.index_copy(-1, positions[held] - first, values.index_select(-1, held))

    def _every_rank_slots(self, values: Tensor, positions: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """Every rank's ``values`` (slots along ``dim``) and their ``positions`` (int64, one per slot), rank by rank
        along ``dim`` and in ``positions [C * S]``. Collective: one all-gather, the values and the positions as bytes
        (no float dtype holds a position exactly)."""
        payload = torch.cat([values.contiguous().flatten().view(torch.uint8), positions.view(torch.uint8)])
        everyone = gather_dim0(payload, self.group_name, self.world_size).view(self.world_size, -1)
        value_bytes = values.numel() * values.element_size()
        gathered = everyone[:, :value_bytes].contiguous().view(values.dtype).view(self.world_size, *values.shape)
        gathered_positions = everyone[:, value_bytes:].contiguous().view(torch.int64).flatten()
        return gathered.movedim(0, dim).flatten(dim, dim + 1), gathered_positions

    def _tag(self, q: Tensor) -> Optional[Tensor]:
        """The agreement's tag where this layer sends it: the first layer of its cache, with other ranks to agree with
        (``Agreement.finish`` of one rank has nothing to gather either)."""
        sent = self.agreement is not None and self.index == 0 and self.world_size > 1
        return self.agreement.tag(acc_dtype(q.dtype)) if sent else None

    def _record(self, q: Tensor, out: Tensor, tags: Tensor, index: Optional[int]) -> None:
        if self.agreement is not None and self.world_size > 1:
            self.agreement.record(self.index if index is None else index, tags, payload_numel(q[:, :, :1], out))
