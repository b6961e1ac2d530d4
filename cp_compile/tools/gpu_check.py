"""``python -m cp_compile gpu-check``: the GPU checks of one lease, in one call, with one report.

A GPU machine may be lent for minutes, with the torch of its image (2.11 on the machines seen so far) and
nothing installable. So the check runs from a checkout with ``PYTHONPATH=.`` and what the image has, under
one time cap, and writes one JSON report:

``tier``   ``tests/test_cuda.py`` (the block op in fp16/bf16/fp32 under every mask, GQA, head dims 64 and
           128; the packed tiles with windows; the decode kernel; the flex tiles; the Triton merge; ring,
           all-gather and Ulysses at C=2 as two processes sharing the GPU, gloo staging their hops through
           host memory since NCCL refuses two ranks on one device, eager and compiled; the ring's peak memory
           at C=2 and 4) and ``tests/test_triton_merge.py`` (the merge kernel through Triton's interpreter):
           each case's outcome, and the errors it measured as multiples of single-device SDPA's (the rule:
           at most 2).
``bench``  the ring taken apart on the one GPU (``bench --device cuda``, ``tools.bench.virtual``):
           decomposition efficiency, TFLOP/s per rank and host against device time per step at 8K, 32K and
           128K tokens and C = 2, 4 and 8, causal, shortest first, as many as the time left holds.

The tier gets at most ``TIER_SHARE`` of the time, the benchmark what is left; a case or configuration the
cap cut off is reported as not run. ``--dry-run`` runs the same on the CPU: the tier's CPU cases (its CUDA
cases reported skipped with the reason), and the decomposition at small sizes; the test suite runs it.

    PYTHONPATH=. python -m cp_compile gpu-check --out OUT [--minutes 8] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

TIER_FILES = ("tests/test_cuda.py", "tests/test_triton_merge.py")
TIER_SHARE = 0.55
REPORT = "gpu-check.json"
# the decomposition: the GPU benchmark's sizes, and the dry run's on the CPU
BENCH_CUDA = dict(world_sizes=(2, 4, 8), seq_lens=(8192, 32768, 131072), heads=32, head_dim=128, dtype="bfloat16")
BENCH_CPU = dict(world_sizes=(2, 4), seq_lens=(256, 512), heads=2, head_dim=32, dtype="float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"), help=f"folder of the report ({REPORT})")
    p.add_argument("--minutes", type=float, default=8.0, help="time cap of the whole check (default 8)")
    p.add_argument(
        "--dry-run", action="store_true", help="the same cases on the CPU (CUDA-only cases reported as skipped)"
    )
    p.add_argument("--root", type=Path, default=Path("."), help="the checkout whose tests/ the tier runs")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **{name: _version(name) for name in ("triton", "transformers", "pytest")},
    }


def _stop(process: subprocess.Popen) -> None:
    """The tier and every process it started (its ranks): they share its session."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_tier(root: Path, out: Path, seconds: float) -> dict:
    """The tier's pytest run in a session of its own, stopped after ``seconds``; its cases from the case log."""
    log = out / "cases.jsonl"
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "CP_COMPILE_CASE_LOG": str(log.resolve()),
        "PYTHONPATH": os.pathsep.join(p for p in (str(root.resolve()), os.environ.get("PYTHONPATH")) if p),
    }
    # --confcutdir: the checkout's top conftest loads the docs' plugin (sybil), which a GPU image need not have
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "cp_compile.tools.case_log"]
    command += ["--confcutdir", str(root / "tests"), *(str(root / f) for f in TIER_FILES)]
    start = time.monotonic()
    with open(out / "tier.log", "w+") as output:
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=max(seconds, 1.0))
        except subprocess.TimeoutExpired:
            _stop(process)
            returncode = None
        output.seek(0)
        tail = output.read()[-4000:]
    (out / "tier.log").unlink()
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    collected = next((r["collected"] for r in records if "collected" in r), [])
    cases = [r for r in records if "case" in r]
    ended = {c["case"] for c in cases}
    return {
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": returncode is None,
        "returncode": returncode,
        "cases": cases,
        "not_run": [case for case in collected if case not in ended],
        "output_tail": tail,
    }


def run_bench(device: str, deadline: float) -> dict:
    from .bench import virtual

    sizes = BENCH_CUDA if device == "cuda" else BENCH_CPU
    start = time.monotonic()
    try:
        rows = virtual.run(
            torch.device(device), causal=(True,), batch=1, repeats=3, warmup=1, out=None, deadline=deadline, **sizes
        )
    except Exception as error:  # a failed benchmark is a finding of the check, reported beside the tier
        return {"seconds": round(time.monotonic() - start, 1), "rows": [], "error": f"{type(error).__name__}: {error}"}
    return {"seconds": round(time.monotonic() - start, 1), "rows": rows, "error": None}


def error_ratio(case: dict) -> float | None:
    """The case's worst CP error as a multiple of single-device SDPA's (the rule: at most 2); None: none measured."""
    ratios = [err / single if single else (0.0 if err == 0 else float("inf")) for _, err, single in case["errors"]]
    return max(ratios) if ratios else None


def summarize(report: dict) -> dict:
    cases, bench = report["tier"]["cases"], report["bench"]
    count = lambda outcome: sum(c["outcome"] == outcome for c in cases)  # noqa: E731
    ratios = [r for r in map(error_ratio, cases) if r is not None]
    measured = [r for r in bench["rows"] if "skipped" not in r]
    return {
        "passed": count("passed"),
        "failed": count("failed"),
        "skipped": count("skipped"),
        "not_run": len(report["tier"]["not_run"]),
        "worst_error_ratio": max(ratios, default=None),
        "bench_measured": len(measured),
        "bench_not_run": len(bench["rows"]) - len(measured),
        "ok": count("failed") == 0 and bench["error"] is None and report["tier"]["returncode"] in (0, None),
    }


def render(report: dict) -> str:
    """The report as Markdown: what the GPUs page quotes."""
    meta, tier, s = report["meta"], report["tier"], report["summary"]
    ratio = "-" if s["worst_error_ratio"] is None else f"{s['worst_error_ratio']:.2f}"
    lines = [
        f"gpu-check on {meta['device']} (torch {meta['torch']}, CUDA {meta['cuda']}, triton {meta['triton']}, "
        f"transformers {meta['transformers']}){' [dry run]' if report['dry_run'] else ''}",
        "",
        f"tier ({tier['seconds']} s{', stopped at its time cap' if tier['timed_out'] else ''}): "
        f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['not_run']} not run; "
        f"worst error {ratio}x single-device SDPA's (the rule: 2x)",
    ]
    for case in tier["cases"]:
        if case["outcome"] == "failed":
            lines.append(f"- FAILED {case['case']}: {case['reason'].splitlines()[-1] if case['reason'] else ''}")
    if tier["returncode"] not in (0, None) and not s["failed"]:
        lines += ["", "the tier's pytest ended with a failure of its own:", "```", tier["output_tail"][-1500:], "```"]
    bench = report["bench"]
    lines += ["", f"bench ({bench['seconds']} s): ring decomposition on one device"]
    if bench["error"]:
        lines.append(f"- ERROR {bench['error']}")
    if bench["rows"]:
        from .bench.virtual import table

        lines += ["```", table(bench["rows"]), "```"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible; --dry-run runs the same cases on the CPU")
        return 2
    missing = [f for f in TIER_FILES if not (args.root / f).is_file()]
    if missing:
        print(f"gpu-check runs from a checkout of cp_compile: {', '.join(missing)} not under {args.root} (--root)")
        return 2
    deadline = time.monotonic() + args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run, "minutes": args.minutes, "meta": environment(device)}
    report["tier"] = run_tier(args.root, args.out, TIER_SHARE * args.minutes * 60)
    report["bench"] = run_bench(device, deadline)
    report["summary"] = summarize(report)
    (args.out / REPORT).write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"\nwrote {args.out / REPORT}")
    return 0 if report["summary"]["ok"] else 1
