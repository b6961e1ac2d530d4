"""Stage 1: replace attention calls in the Dynamo graph with CP ops.

Runs on the graph a ``torch.compile`` backend receives, before AOTAutograd, so
the CP op's registered autograd becomes the backward graph. It walks every
graph module, including the bodies of higher-order ops (``torch.utils.checkpoint``
regions, SAC, other wrapped regions), which hang off the top-level module
as submodules.

The pass is match -> check -> rewrite:

- ``find_sites`` returns one ``AttentionSite`` per attention call, of any of
  the ``SITE_PATTERNS`` (each pattern knows how to match, check and rewrite its op);
- the pattern's ``check`` raises ``UnsupportedAttention`` (naming the argument)
  for what CP cannot reproduce exactly (for SDPA: ``dropout_p > 0``, an
  ``attn_mask`` tensor);
- ``compiler.choose.choose_schedule`` picks the schedule, and the pattern's
  ``rewrite`` inserts that schedule's CP op, reroutes the users of the old
  output and erases the attention node.
"""

from __future__ import annotations

import torch.fx as fx

from .cp_site import CP_PATTERN
from .flex_site import FLEX_PATTERN
from .sdpa_site import SDPA_PATTERN
from .site import AttentionSite, SitePattern, _graph_modules, input_values
from .unrewritten import strip_unrewritten
from .varlen_site import VARLEN_PATTERN

SITE_PATTERNS: list[SitePattern] = [SDPA_PATTERN, VARLEN_PATTERN, FLEX_PATTERN, CP_PATTERN]


def find_sites(gm: fx.GraphModule, example_inputs=()) -> list[AttentionSite]:
    sites, values = [], input_values(gm, example_inputs)
    for path, module in _graph_modules(gm):
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            for pattern in SITE_PATTERNS:
                args = pattern.match(node)
                if args is not None:
                    sites.append(AttentionSite(module, path, node, args, pattern.name, values=values))
                    break
    return sites


def handler(site: AttentionSite) -> SitePattern:
    return next(p for p in SITE_PATTERNS if p.name == site.pattern)


def check_site(site: AttentionSite) -> None:
    handler(site).check(site)


def rewrite_attention(gm: fx.GraphModule, plan, example_inputs=()) -> list[AttentionSite]:
    """Stage 1 over a whole Dynamo graph module (HOP bodies included); ``example_inputs``: what the backend was
    given with it."""
    strip_unrewritten(gm)  # the markers the plan's guard put in front of the calls rewritten here
    sites = find_sites(gm, example_inputs)
    for site in sites:
        check_site(site)
    for site in sites:
        handler(site).rewrite(site, plan)
    touched = {id(s.owner): s.owner for s in sites}
    for module in touched.values():
        module.graph.lint()
        module.recompile()
    return sites
