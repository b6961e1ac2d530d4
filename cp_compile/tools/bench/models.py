"""``python -m cp_compile models``: every decoder-only causal-LM family of the installed transformers under CP.

For each family of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (encoder-decoder,
encoder and multimodal families are skipped, each with its reason) a tiny
model is built from the family's own config and model classes: the config's
defaults, every known size field shrunk (hidden 64, 4/2 heads, 128 vocab,
a few small experts, windows and chunks of 16 tokens, no dropout), as many
layers as it takes to hold every layer type the family has, and a short
per-family override table where the generic shrink is not enough. Random
weights, fp32, seeded: the same on every rank and in the reference.

On C local gloo ranks (one warm ``RankPool`` for the whole sweep), with
``attn_implementation="cp_compile"``, against the same weights with ``"sdpa"``
(``"eager"`` where a family has no SDPA path) on one process:

- **train**: 64 tokens, batch 1, sharded by the plan with global
  ``position_ids``; the loss on the global shifted labels (sharded; the sum of
  token losses over the global count), backward, gradients all-reduced;
  the loss, logits and every gradient compared (relative to the largest
  magnitude of the reference's);
- **generate**: ``cp_compile.hf.generate(model, prompt, max_new_tokens=12,
  do_sample=False)`` after a 37-token prompt against ``model.generate`` on
  one process: the tokens (and the logits of every step);
- **batch**: the same for a batch of four prompts (37, 1, 12 and 5 tokens)
  padded on the left and generated together, or ``refused`` with the reason a
  batch cannot share one sharded cache (``hf.generate.why_not_batched``).

Each phase is ``exact`` (within ``TOL``), ``refused`` (one of cp_compile's
own errors: ``UnsupportedAttention``, ``LocalAttentionError``, or a
``ValueError`` / ``NotImplementedError`` raised in cp_compile),
``not-loadable`` (transformers itself cannot build the model with
``attn_implementation="cp_compile"``: it looks its own attention classes up by
name), ``wrong`` (ran and differs: the silent failure), ``failed`` (any other
exception) or ``reference-failed`` (the one-process model failed: nothing to
compare).

Every family runs on process groups of its own (one per phase, with a short
timeout), so an exception on one rank that leaves another waiting in a
collective costs that family the timeout and nothing more; a family that
kills or hangs a rank is reported as failed and the pool restarts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from .model_configs import FAMILY_TIMEOUT_S, NEW, PROMPT, STATUSES, TOL, causal_lm_families, skip_reason
from .model_run import PHASES, _first_line, family_on_rank, seq_len

# --- the sweep, on the caller's side ------------------------------------------------------------------------

SEVERITY = (
    "wrong",
    "failed",
    "reference-failed",
    "not-loadable",
    "refused",
    "exact",
)  # the worst rank's status is the family's


def _merge_phase(per_rank: list[dict]) -> dict:
    statuses = [r["status"] for r in per_rank]
    worst = min(statuses, key=SEVERITY.index)
    if len(set(statuses)) > 1:  # ranks disagree: say what each saw
        return {
            "status": worst,
            "detail": "; ".join(
                f"rank {i} {r['status']}: {r.get('detail') or describe_phase(r)}" for i, r in enumerate(per_rank)
            ),
            "ranks": per_rank,
        }
    merged = dict(per_rank[0])
    for key in ("loss", "logits", "grads"):  # the largest difference over the ranks
        values = [r[key] for r in per_rank if key in r]
        if values:
            merged[key] = max(values)
            if key == "grads":
                merged["worst_grad"] = max(per_rank, key=lambda r: r[key])["worst_grad"]
    return merged


def describe_phase(phase: dict) -> str:
    """A short human-readable detail of one phase's result."""
    if "detail" in phase:
        return phase["detail"]
    if "grads" in phase:  # train
        worst = max(phase["loss"], phase["logits"], phase["grads"])
        text = (
            f"max rel diff {worst:.1e} (loss {phase['loss']:.1e}, logits {phase['logits']:.1e}, "
            f"grads {phase['grads']:.1e}"
        )
        if phase["status"] != "wrong":
            return text + ")"
        hint = "" if phase.get("attention_calls") else "; never called the attention interface"
        return text + f" in {phase['worst_grad']}{hint})"
    if phase.get("first_diff") is None:
        return f"{phase['tokens']} tokens same, logits {phase['logits']:.1e}"
    return (
        f"{phase['differ']} of {phase['tokens']} tokens differ from token {phase['first_diff']}, "
        f"logits {phase['logits']:.1e}"
    )


def run_family(run: Callable, name: str, timeout: float = FAMILY_TIMEOUT_S) -> dict:
    """One family on every rank through ``run(fn, *args, timeout=...)`` (``RankPool.run``, or the test
    fixture); a rank that raises outside the phases, dies or hangs makes the family ``failed``."""
    from ..launch import RankError

    start = time.perf_counter()
    try:
        per_rank = run(family_on_rank, name, timeout=timeout)
    except (RankError, TimeoutError) as e:
        if isinstance(e, RankError):
            rank, (error_type, message, _) = sorted(e.errors.items())[0]
            detail = f"rank {rank} raised {error_type}: {(message.strip().splitlines() or [''])[0][:160]}"
        else:
            detail = f"{type(e).__name__}: {_first_line(e)}"
        phase = {"status": "failed", "detail": detail}
        return {"family": name, **{p: dict(phase) for p in PHASES}, "seconds": time.perf_counter() - start}
    row = {k: v for k, v in per_rank[0].items() if k not in PHASES}
    for phase in PHASES:
        row[phase] = _merge_phase([r[phase] for r in per_rank])
    row["seconds"] = time.perf_counter() - start
    return row


def sweep(
    names: list[str], run: Callable, timeout: float = FAMILY_TIMEOUT_S, on_row: Optional[Callable[[dict], None]] = None
) -> list[dict]:
    """Every family in ``names`` (skipped ones with their reason), each run on the ranks behind ``run``."""
    rows = []
    for name in names:
        reason = skip_reason(name)
        row = {"family": name, "skipped": reason} if reason else run_family(run, name, timeout)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _status(row: dict, phase: str) -> str:
    return "skipped" if row.get("skipped") else row[phase]["status"]


def detail(row: dict) -> str:
    if row.get("skipped"):
        return row["skipped"]
    train, gen = row["train"], row["generate"]
    if row.get("takes_position_ids") is False:
        row = {**row, "note": "; ".join(filter(None, [row.get("note"), "forward() has no position_ids"]))}
    if train["status"] == gen["status"] and train.get("detail") and train.get("detail") == gen.get("detail"):
        text = train["detail"]
    else:
        text = f"train: {describe_phase(train)}; generate: {describe_phase(gen)}"
    batch = row["batch"]
    if batch.get("detail") != train.get("detail"):  # a failure before the phases says the same for all three
        text += f"; batch: {describe_phase(batch)}"
    return f"{text} [{row['note']}]" if row.get("note") else text


COLUMNS = (26, 16, 16, 16)


def table_header() -> str:
    return f"{'family':<{COLUMNS[0]}} {'train':<{COLUMNS[1]}} {'generate':<{COLUMNS[2]}} {'batch':<{COLUMNS[3]}} detail"


def table_row(row: dict) -> str:
    return (
        f"{row['family']:<{COLUMNS[0]}} {_status(row, 'train'):<{COLUMNS[1]}} "
        f"{_status(row, 'generate'):<{COLUMNS[2]}} {_status(row, 'batch'):<{COLUMNS[3]}} {detail(row)}"
    )


def summary(rows: list[dict]) -> str:
    ran = [r for r in rows if not r.get("skipped")]
    parts = [f"{len(rows)} families: {len(ran)} run, {len(rows) - len(ran)} skipped"]
    for phase in PHASES:
        counts = {s: sum(r[phase]["status"] == s for r in ran) for s in STATUSES}
        parts.append(f"{phase}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "; ".join(parts)


def _route(row: dict) -> str:
    """The route that ran the family under the plan, where it ran."""
    return row.get("route", "") if any(_status(row, phase) == "exact" for phase in ("train", "generate")) else ""


def markdown(rows: list[dict], meta: dict) -> str:
    """The table as a Markdown section (what docs/guides/models.md embeds)."""

    def cell(text: str) -> str:  # Markdown-safe: no table breaks, no HTML, no emphasis from code names
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")
        for char in "\\`*_[]|":
            text = text.replace(char, "\\" + char)
        return text

    lines = [
        f"<!-- generated by `{meta['command']}` on {meta['date']}: transformers {meta['transformers']}, "
        f"torch {meta['torch']}, C={meta['world_size']}, {meta['seconds']:.0f} s -->",
        "",
        f"*{summary(rows)}.*",
        "",
        "| Family | Train | Generate | Batch | Route | Detail |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| `{row['family']}` | {_status(row, 'train')} | {_status(row, 'generate')} | {_status(row, 'batch')} | "
        f"{_route(row)} | {cell(detail(row))} |"
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--families",
        default=None,
        help="comma list of model types (as in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); default: all",
    )
    p.add_argument("--world-size", "-C", type=int, default=2, help="CP ranks (default 2)")
    p.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT_S, help="seconds per family on the ranks")
    p.add_argument("--out", type=Path, default=None, help="JSON with every row and its measurements")
    p.add_argument("--markdown", type=Path, default=None, help="the table as a Markdown section (for the docs)")


def main(args: argparse.Namespace) -> int:
    import sys

    import torch
    import transformers

    from ..launch import RankPool

    known = causal_lm_families()
    names = [n for n in args.families.split(",") if n] if args.families else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"not causal-LM families of transformers {transformers.__version__}: {', '.join(unknown)}", file=sys.stderr
        )
        return 2
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, C={args.world_size} gloo ranks; "
        f"train: {seq_len(args.world_size)} tokens, generate: {NEW} tokens after {PROMPT}; "
        f"exact within {TOL:g} relative"
    )
    print(table_header(), flush=True)
    start = time.perf_counter()
    with RankPool(args.world_size) as pool:
        rows = sweep(names, pool.run, args.timeout, on_row=lambda row: print(table_row(row), flush=True))
    seconds = time.perf_counter() - start
    print(summary(rows))
    print(f"{seconds:.0f} s")
    meta = {
        "command": "python -m cp_compile models"
        + (f" -C {args.world_size}" if args.world_size != 2 else "")
        + (f" --families {args.families}" if args.families else ""),
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "world_size": args.world_size,
        "seconds": seconds,
        "seq": seq_len(args.world_size),
        "prompt": PROMPT,
        "new_tokens": NEW,
        "tolerance": TOL,
    }
    for path, text in (
        (args.out, json.dumps({"meta": meta, "rows": rows}, indent=1, default=str)),
        (args.markdown, markdown(rows, meta)),
    ):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return 1 if any(not r.get("skipped") and "wrong" in [r[phase]["status"] for phase in PHASES] for r in rows) else 0
