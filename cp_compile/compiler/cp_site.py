"""Attention site pattern "cp": a schedule's whole op the model called itself, already in the graph.

Attention that torch's calls cannot express (chunked attention, soft-capped
scores, attention sinks through the returned lse; ``cp_compile.hf`` runs them
with ``cp_compile.varlen_attention``) reaches the Dynamo graph as the
schedule's whole op. Nothing is rewritten: the op is already CP, and Stage 2
expands it like any other. The site is recorded so that ``explain`` lists it,
with the schedule the call named and the kind's options.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx

from ..kinds.call import Call
from ..schedules.registry import FORWARD_OPS
from .site import AttentionSite, Decision, SitePattern


def _match_cp(node: fx.Node) -> Optional[dict[str, Any]]:
    target = getattr(node.target, "default", node.target)  # an op packet or its overload
    if target not in FORWARD_OPS:
        return None
    (q, k, v, extra), call, enable_gqa = Call.from_op_args(node.args, 4)
    return {
        "query": q,
        "key": k,
        "value": v,
        "extra": extra,
        "groups": call.groups,
        "is_causal": call.is_causal,
        "layout": call.layout,
        "scale": call.scale,
        "enable_gqa": enable_gqa,
        "kind": call.kind,
        "settings": call.settings,
        "schedule": target.__name__.split(".")[0].removesuffix("_attention"),
    }


def _check_cp(site: AttentionSite) -> None:
    """The op checks its own arguments, on every rank, when it runs."""


def _record_cp(site: AttentionSite, plan) -> None:
    args = site.args
    encoded = "" if args["settings"] is None else args["settings"].encode()
    detail = f"{args['kind']} kind" + (f", {encoded}" if encoded else "")
    causal = bool(args["is_causal"])
    if args["kind"] == "packed":  # the packed kind is causal through its window
        causal = args["settings"].right == 0
    site.decision = Decision(args["schedule"], f"called as a CP op ({detail})", causal)


CP_PATTERN = SitePattern("cp", _match_cp, _check_cp, _record_cp)
