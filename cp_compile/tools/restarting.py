"""Kernels that restart at packed documents, for one process on a machine without the fused kernels.

Given what a padding-free collator adds to a packed row (``seq_idx``, ``cu_seq_lens_q``), transformers' hybrid
models ask their convolutions and scans to restart at each document: causal-conv1d and mamba_ssm's chunked scan
read ``seq_idx``, fla's delta rules ``cu_seqlens``. Their torch bodies, all a CPU has, refuse both. Inside
``restarting_kernels(module)`` the modeling module's mixer functions are stand-ins that run the torch body on each
document alone and join the outputs: what the fused kernels compute, at the body's speed. A one-process run of a
packed hybrid model can then be compared with the same run under a plan (which restarts at documents itself).
"""

from __future__ import annotations

import contextlib
import inspect
from types import ModuleType

import torch

# what each fused kernel restarts at, and the dim of the tokens in its inputs (the functions by the name the
# modeling files call them by)
RESTARTS_AT = {
    "causal_conv1d_fn": ("seq_idx", 2),
    "torch_chunk_gated_delta_rule": ("cu_seqlens", 1),
    "chunk_kimi_delta_attention": ("cu_seqlens", 1),
    "mamba2_chunk_scan": ("seq_idx", 1),
}
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")  # fused paths whose torch bodies return None


def _each_document_alone(body, marks_name: str, dim: int):
    def kernel(*args, **kwargs):
        marks = kwargs.get(marks_name)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("seq_idx", "cu_seqlens")}
        if marks is None:
            return body(*args, **kwargs)
        lengths = (
            marks.diff() if marks_name == "cu_seqlens" else torch.unique_consecutive(marks[0], return_counts=True)[1]
        )
        total = args[0].shape[dim]

        def split(t):
            per_token = isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == total
            return t.split(lengths.tolist(), dim) if per_token else [t] * len(lengths)

        names = list(kwargs)
        outs = [
            body(*c[: len(args)], **dict(zip(names, c[len(args) :])))
            for c in zip(*(split(a) for a in args), *(split(kwargs[k]) for k in names))
        ]
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs, dim)
        finals = [o[1] for o in outs]  # (output, final state per document or None)
        return torch.cat([o[0] for o in outs], dim), None if finals[0] is None else torch.cat(finals)

    return kernel


@contextlib.contextmanager
def restarting_kernels(module: ModuleType):
    """While the context lasts, ``module``'s (a transformers modeling module) mixer functions restart at documents
    as the fused kernels do; its fused paths are off, so that the model takes the steps above."""
    saved = {name: getattr(module, name) for name in (*RESTARTS_AT, *FUSED) if hasattr(module, name)}
    try:
        for name, function in saved.items():
            if name in FUSED:
                setattr(module, name, lambda *args, **kwargs: None)
            else:
                setattr(module, name, _each_document_alone(inspect.unwrap(function), *RESTARTS_AT[name]))
        yield
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


__all__ = ["RESTARTS_AT", "restarting_kernels"]
