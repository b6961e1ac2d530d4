"""One family of ``python -m cp_compile models`` on every rank: train and generate under CP against one
process, each phase's outcome (see ``models`` for the statuses and what is compared).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import inspect
import io
import traceback
from pathlib import Path
from typing import Any

from .model_configs import (
    GRAD_FLOOR,
    GROUP_TIMEOUT_S,
    ID_RANGE,
    NEW,
    PROMPT,
    SEQ,
    TOL,
    _layer_kinds,
    _quiet,
    first_id,
    tiny_config,
)

# --- one family, on every rank ------------------------------------------------------------------------------


def seq_len(world_size: int) -> int:
    """Training tokens: SEQ, rounded up to a multiple of 2C (the zigzag layout's chunks)."""
    return -(-SEQ // (2 * world_size)) * 2 * world_size


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(filename: str, lineno: int) -> str:
    """A short file:line: from the package (transformers/..., torch/..., cp_compile/...) down."""
    parts = Path(filename).parts
    for root in ("cp_compile", "transformers", "torch", "huggingface_hub"):
        if root in parts:
            return f"{'/'.join(parts[len(parts) - 1 - parts[::-1].index(root) :])}:{lineno}"
    return f"{Path(filename).name}:{lineno}"


_PACKAGE = Path(__file__).resolve().parents[2]  # cp_compile/
_INSTRUMENTS = _PACKAGE / "tools"  # this command and its kin: their errors are not the library's
# Inside a plan every torch call passes through the plan's TorchFunctionMode (guard.py): an error a torch op
# raises shows that frame last. It is a pass-through, not where the error comes from.
_PASS_THROUGH = (_PACKAGE / "guard.py",)


def _raised_in_cp_compile(e: BaseException) -> bool:
    """``e`` was raised by cp_compile's own code (not by this command, nor by a torch op the plan's guard
    passed through)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    path = Path(frames[-1].filename).resolve()
    return _PACKAGE in path.parents and path not in _PASS_THROUGH and _INSTRUMENTS not in path.parents


def _located(e: BaseException) -> str:
    """`` (file:line)`` of the innermost frame of ``e`` that is not a pass-through, or ""."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() not in _PASS_THROUGH]
    return f" ({_where(frames[-1].filename, frames[-1].lineno)})" if frames else ""


def outcome(e: BaseException) -> tuple[str, str]:
    """(status, detail) of an exception from a CP run: ``refused`` for cp_compile's own clear errors, else
    ``failed`` (type, first line, innermost file:line)."""
    from ... import LocalAttentionError, UnsupportedAttention

    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:  # Dynamo and others wrap the error they hit
        seen.add(id(cause))
        if isinstance(cause, (UnsupportedAttention, LocalAttentionError)):
            return "refused", f"{type(cause).__name__}: {_first_line(cause)}"
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    if isinstance(e, (ValueError, NotImplementedError)) and _raised_in_cp_compile(e):
        return "refused", f"{type(e).__name__}: {_first_line(e)}"
    return "failed", f"{type(e).__name__}: {_first_line(e)}{_located(e)}"


def _reference_failed(e: BaseException) -> dict:
    return {"status": "reference-failed", "detail": f"one process: {type(e).__name__}: {_first_line(e)}{_located(e)}"}


def _rel(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (0 when both are all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(b.abs().max().item() if b.numel() else 0.0, floor)
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _token_loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _build(cls, config, attn: str):
    import torch

    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32)


def _reference_model(cls, config):
    """The one-process model: "sdpa", or "eager" where the family has no SDPA path."""
    try:
        return _build(cls, config, "sdpa"), "sdpa"
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return _build(cls, config, "eager"), "eager"


@contextlib.contextmanager
def _counting_attention(calls: list):
    """Counts the calls of the "cp_compile" attention function meanwhile: a model that never calls it does not
    go through transformers' attention interface."""
    from transformers import AttentionInterface

    from ...hf import NAME

    original = AttentionInterface._global_mapping[NAME]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    AttentionInterface.register(NAME, counted)
    try:
        yield
    finally:
        AttentionInterface.register(NAME, original)


def _train(model, reference, group) -> dict:
    """One training step on seq_len(C) tokens under CP against one process: loss, logits and summed gradients."""
    import torch
    import torch.distributed as dist

    import cp_compile

    seq = seq_len(dist.get_world_size(group))
    ids = torch.randint(first_id(model.config), ID_RANGE, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # shifted on the global sequence
    items = int((labels != -100).sum())
    try:
        reference.train()
        ref_out = reference(ids, use_cache=False)
        ref_loss = _token_loss(ref_out.logits, labels) / items
        ref_loss.backward()
    except Exception as e:  # noqa: BLE001
        return _reference_failed(e)
    plan = cp_compile.ContextParallel(group)
    calls = [0]
    try:
        model.train()
        with plan, _counting_attention(calls):
            out = model(plan.shard(ids, 1), position_ids=plan.positions(seq)[None], use_cache=False)
            loss = _token_loss(out.logits, plan.shard(labels, 1)) / items  # this rank's share of the global mean
            loss.backward()
        params = [(n, p) for n, p in model.named_parameters()]
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in params])
        total = torch.cat([loss.detach().reshape(1), grads])
        dist.all_reduce(total, group=group)  # loss and gradients summed over the CP ranks
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        return {"status": status, "detail": detail}
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}
    # Each gradient relative to its own largest magnitude, floored at GRAD_FLOOR of the model's largest: a
    # gradient that is zero analytically (a key projection's bias: softmax ignores a per-query constant) is
    # rounding noise on both sides, and noise relative to noise says nothing.
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    summed = total[1:].split([p.numel() for _, p in params])
    errors = {name: _rel(g.view_as(p), ref_grads[name], floor) for (name, p), g in zip(params, summed)}
    worst_name = max(errors, key=errors.get, default=None)  # the first of the largest
    worst = errors.get(worst_name, 0.0)
    metrics = {
        "loss": _rel(total[0], ref_loss.detach()),
        "logits": _rel(out.logits, plan.shard(ref_out.logits, 1)),
        "grads": worst,
        "worst_grad": worst_name,
        "attention_calls": calls[0],
    }
    return {"status": "exact" if max(metrics["loss"], metrics["logits"], worst) <= TOL else "wrong", **metrics}


def _generate(model, reference, group) -> dict:
    """Greedy generation after a PROMPT-token prompt: cp_compile.hf.generate against model.generate."""
    import torch

    prompt = torch.randint(first_id(model.config), ID_RANGE, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    return _generated_against(model, reference, group, prompt, {})


# the batch phase's prompts, padded on the left to the longest: lengths that split unevenly over 2C chunks, and one
# token (a row with nothing to prefill)
BATCH_PROMPTS = (PROMPT, 1, PROMPT // 3, 5)


def _generate_batch(model, reference, group) -> dict:
    """Greedy generation of a batch of BATCH_PROMPTS, padded on the left: cp_compile.hf.generate against
    model.generate of the same batch; ``refused`` with the reason where a batch cannot share one sharded cache."""
    import torch

    import cp_compile
    from cp_compile.hf.generate import why_not_batched

    from ..generate_batch import left_padded

    why = why_not_batched(model, cp_compile.ContextParallel(group))
    if why is not None:
        return {"status": "refused", "detail": f"a batch: {why}"}
    pad = first_id(model.config)
    seeded = (torch.Generator().manual_seed(2 + row) for row in range(len(BATCH_PROMPTS)))
    prompts, mask = left_padded(
        [torch.randint(pad, ID_RANGE, (n,), generator=g) for n, g in zip(BATCH_PROMPTS, seeded)], pad
    )
    return _generated_against(model, reference, group, prompts, dict(attention_mask=mask, pad_token_id=pad))


def one_process_cache(model) -> dict:
    """``generate`` kwargs of the one-process run a ``ShardedCache`` matches: transformers' static cache where the
    family has an indexer (DSA), whose top k a ``ShardedCache`` scores over every preallocated row as a static cache
    does; ties then break alike (``hf.cache.ShardedIndexedLayer``)."""
    from cp_compile.hf.families import family_of

    return {"cache_implementation": "static"} if family_of(model).indexer is not None else {}


def _generated_against(model, reference, group, prompts, extra: dict) -> dict:
    import torch

    import cp_compile
    import cp_compile.hf

    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True, **extra)
    try:
        reference.eval()
        with torch.no_grad():
            ref = reference.generate(prompts, **kwargs, **one_process_cache(reference))
    except Exception as e:  # noqa: BLE001
        return _reference_failed(e)
    plan = cp_compile.ContextParallel(group)
    try:
        model.eval()
        with plan, torch.no_grad():
            out = cp_compile.hf.generate(model, prompts, **kwargs)
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        return {"status": status, "detail": detail}
    width = prompts.shape[1]
    mine, theirs = out.sequences[:, width:].flatten().tolist(), ref.sequences[:, width:].flatten().tolist()
    steps = min(len(out.logits), len(ref.logits))
    logits = _rel(torch.stack(out.logits[:steps]), torch.stack(ref.logits[:steps])) if steps else 0.0
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if first is None and len(mine) != len(theirs):
        first = min(len(mine), len(theirs))
    return {
        "status": "exact" if first is None and logits <= TOL else "wrong",
        "logits": logits,
        "first_diff": first,
        "tokens": len(theirs),
        "differ": sum(a != b for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs)),
    }


PHASES = ("train", "generate", "batch")  # a batch: left-padded prompts generated together


def family_on_rank(name: str, group_timeout: float = GROUP_TIMEOUT_S) -> dict:
    """Runs on every rank: build the family's tiny model twice (CP, reference), then both phases.

    Each phase runs on a process group of its own (the plan's group: ``ContextParallel(group)``) with a short
    timeout, and the ranks meet on the default group after each phase: a rank left waiting in a collective
    because another rank raised gives up after the timeout, and the next phase or family starts in step, from
    clean groups."""
    import torch.distributed as dist

    import cp_compile.hf  # noqa: F401  (registers attn_implementation="cp_compile")

    groups = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout)) for _ in PHASES]
    try:
        with _quiet(), contextlib.redirect_stdout(io.StringIO()):  # some model code prints
            return _family(name, groups)
    finally:
        for group in groups:
            _destroy(group)


def _destroy(group) -> None:
    """Destroys a phase's group on this rank (each phase starts from a group of its own)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001  (destroyed already, or left broken by a failed collective)
        pass


def _family(name: str, groups) -> dict:
    import torch.distributed as dist

    from ...hf.families import family_of

    row: dict[str, Any] = {"family": name}
    try:
        config, cls, note = tiny_config(name)
        row.update(
            model=cls.__name__,
            config=type(config).__name__,
            note=note,
            layer_types=sorted(set(_layer_kinds(config) or [])) or None,
        )
        reference, row["reference"] = _reference_model(cls, config)
    except Exception as e:  # noqa: BLE001
        failed = _reference_failed(e)
        failed["detail"] = failed["detail"].replace("one process:", "building the tiny model:", 1)
        return {**row, **{phase: dict(failed) for phase in PHASES}}
    try:
        model = _build(cls, config, "cp_compile")
        model.load_state_dict(reference.state_dict())
    except Exception as e:  # noqa: BLE001
        status, detail = outcome(e)
        if isinstance(e, KeyError) and e.args == ("cp_compile",):  # a table of the model's own attention classes
            status = "not-loadable"
            detail = (
                f"transformers cannot build {cls.__name__} with attn_implementation='cp_compile': the model "
                f"looks its attention classes up by name ({detail}); cp_compile never runs"
            )
        return {**row, **{phase: {"status": status, "detail": detail} for phase in PHASES}}
    row.update(
        parameters=sum(p.numel() for p in model.parameters()),
        route=family_of(model).route,
        takes_position_ids="position_ids" in inspect.signature(type(model).forward).parameters,
    )
    for phase, run, group in zip(PHASES, (_train, _generate, _generate_batch), groups):
        row[phase] = run(model, reference, group)
        # every rank waits here for the others to finish the phase (on the default group, whose timeout outlasts a
        # phase group's): a rank that raised early must not start the next phase's collectives while another still
        # waits out a collective of this one
        dist.barrier()
        _destroy(group)
    return row
