"""``MaskSpec``: the mask of one kind of attention layer as cp_compile's mask function hands it to the model under a
plan (``hf.masks``), in place of a tensor no rank could hold."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UnsupportedAttention
from ..torch_compat import higher_order_operator

_REGION = higher_order_operator()  # read at import: Dynamo does not trace the lookup
_TENSOR_API = frozenset(n for n in dir(torch.Tensor) if not n.startswith("__"))


@dataclass(frozen=True)
class MaskSpec:
    """The mask of one kind of attention layer, as CP runs it (global positions).

    ``window``: transformers' ``sliding_window`` w (a key is visible when ``q - k < w``); ``chunk``:
    keys visible only inside the query's chunk of ``chunk`` positions. Model code that reads the
    mask as a tensor (indexing it) raises: under CP there is none.
    """

    causal: bool = True
    window: Optional[int] = None
    chunk: Optional[int] = None
    model: str = ""
    # the layer's attention module slices its mask for a sparse-attention indexer (``mask[:, 0, :, :]``): the
    # slice is the spec again, and the indexer's hook (``hf.indexed``) gives the indexer a mask of its own
    indexed: bool = False
    # the mask function keeps packed documents apart (transformers found them from the positions it was given): a
    # module over the gathered sequence that reads the mask tensor is given them (``hf.gathered``); the attention
    # function takes the documents from ``cu_seq_lens_q`` or the plan whatever this says. None: not known (a window
    # layer's mask while Dynamo traces)
    documents: Optional[bool] = False
    # the model turned the mask into booleans (``mask.to(torch.bool)``, MPT): True where a key is masked, as one
    # process's additive mask becomes; a module over the gathered sequence is given that form (``hf.gathered``)
    as_bool: bool = False

    # transformers tells a 2-D padding mask from a prepared one by ``ndim`` (generation prepares the masks
    # of a compileable cache, a ShardedCache, once and hands them back to the model's mask builders)
    ndim = 4

    def refuse(self, *_args, **_kwargs):
        raise UnsupportedAttention(
            f"{self.model or 'the model'} uses the attention mask as a tensor outside the attention function (its "
            "own attention code, a sparse-attention indexer, a mask sliced or added to scores); under context "
            "parallelism no rank holds the mask of the whole sequence, so this model cannot run under a plan"
        )

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype", args[0] if args else None)
        if dtype is not torch.bool:
            self.refuse()
        return dataclasses.replace(self, as_bool=True)

    def __getitem__(self, index):
        if not self.indexed:
            self.refuse()
        return self

    # whatever else a tensor mask would be used for: arithmetic, torch functions, tensor methods
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = refuse
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __neg__ = refuse

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if isinstance(func, _REGION):
            # a region handed the layer's arguments as they are (activation checkpointing while Dynamo traces a
            # layer whose mask is positional): the spec reaches the attention function inside it
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, MaskSpec)).refuse()

    def __getattr__(self, name: str):
        if name in _TENSOR_API:
            self.refuse()
        raise AttributeError(name)


__all__ = ["MaskSpec"]
