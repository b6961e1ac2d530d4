"""Attention site pattern "sdpa": ``F.scaled_dot_product_attention`` with ``is_causal`` or no mask.

The rewrite inserts the chosen schedule's whole op with the ``"sdpa"`` kind.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import UnsupportedAttention
from ..kinds.call import Call
from .choose import choose_schedule
from .site import AttentionSite, SitePattern, constant, insert_schedule

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stand-in with SDPA's documented signature, for binding graph arguments."""


_SDPA_SIGNATURE = inspect.signature(_sdpa_signature)


def _check_sdpa(site: AttentionSite) -> None:
    args = site.args
    where = f"at {site.source}"
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        args[name] = constant(args[name])
    if args["attn_mask"] is not None:
        hint = "use is_causal=True, or FlexAttention for custom masks"
        if "transformers" in (site.node.meta.get("stack_trace") or ""):  # a mask built by Hugging Face
            hint = (
                "for a Hugging Face transformers model, `import cp_compile.hf` and load or switch it with "
                'attn_implementation="cp_compile" (model.set_attn_implementation("cp_compile")), and run it '
                "inside `with plan:`"
            )
        raise UnsupportedAttention(
            f"scaled_dot_product_attention(attn_mask=...) {where}: an explicit attn_mask tensor is not supported "
            f"under context parallelism (each rank holds only its shard of the sequence); {hint}"
        )
    dropout = args["dropout_p"]
    if isinstance(dropout, fx.Node) or dropout != 0.0:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention(dropout_p={dropout}) {where}: attention dropout is not supported "
            "under context parallelism; use dropout_p=0.0 (e.g. model.eval() or dropout_p=0 in the module)"
        )
    for name in ("is_causal", "scale", "enable_gqa"):
        if isinstance(args[name], fx.Node):
            raise UnsupportedAttention(
                f"scaled_dot_product_attention({name}=<traced value>) {where}: must be a constant"
            )
    q_shape, k_shape = site.shape("query"), site.shape("key")
    if q_shape is None or k_shape is None:
        raise UnsupportedAttention(f"scaled_dot_product_attention {where}: no example shapes in the graph")
    if len(q_shape) != 4:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention {where}: CP needs [B, H, S, D] inputs, got a {len(q_shape)}-D query"
        )


def _rewrite_sdpa(site: AttentionSite, plan) -> None:
    """Replace the SDPA node with the chosen schedule's CP op."""
    args = site.args
    head_dim = site.shape("query")[-1]
    scale = float(args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(head_dim))
    site.decision = choose_schedule(site, plan, bool(args["is_causal"]))
    schedule = site.decision.schedule
    call = Call("sdpa", plan.groups(schedule), bool(args["is_causal"]), plan.load_balance, scale)
    _, out = insert_schedule(
        site, schedule, args["query"], args["key"], args["value"], [], call, args["enable_gqa"], outputs_used=1
    )
    site.node.replace_all_uses_with(out)
    site.owner.graph.erase_node(site.node)


def _match_sdpa(node: fx.Node) -> Optional[dict[str, Any]]:
    if node.target not in SDPA_TARGETS:
        return None
    bound = _SDPA_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


SDPA_PATTERN = SitePattern("sdpa", _match_sdpa, _check_sdpa, _rewrite_sdpa)
