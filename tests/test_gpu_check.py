"""``python -m cp_compile gpu-check --dry-run``: the GPU check's cases on the CPU, as a lent GPU machine runs
them (a subprocess from the checkout, one JSON report), and its time cap."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def gpu_check(out: Path, *args: str) -> tuple[int, dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "cp_compile", "gpu-check", "--dry-run", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, json.loads((out / "gpu-check.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return gpu_check(tmp_path_factory.mktemp("gpu_check"))


def test_dry_run_passes_every_cpu_case_and_skips_the_cuda_ones_with_the_reason(dry_run):
    code, report, printed = dry_run
    assert code == 0, printed
    cases = report["tier"]["cases"]
    assert not report["tier"]["not_run"] and not report["tier"]["timed_out"]
    cuda = [c for c in cases if c["case"].endswith("-cuda]") or "[cuda" in c["case"]]
    assert cuda and all(c["outcome"] == "skipped" and "no CUDA device visible" in c["reason"] for c in cuda)
    ran = [c for c in cases if c["outcome"] == "passed"]
    assert len(ran) >= 60 and not [c for c in cases if c["outcome"] == "failed"]
    # the error rule's measurements come back per case: the block op's four results, the schedules' per rank
    block = next(c for c in ran if c["case"].startswith("tests/test_cuda.py::test_block_attn_on_device"))
    assert [what for what, _, _ in block["errors"]] == ["out", "dq", "dk", "dv"]
    assert 0 < report["summary"]["worst_error_ratio"] <= 2
    # the Triton merge kernel through Triton's interpreter
    assert any(c["case"].startswith("tests/test_triton_merge.py::test_kernel_matches") for c in ran)
    rows = report["bench"]["rows"]
    assert report["bench"]["error"] is None and len(rows) == 4 and all(r["efficiency"] > 0 for r in rows)
    assert f"{len(ran)} passed" in printed


def test_the_time_cap_reports_what_it_cut_off(tmp_path):
    """A cap that stops the tier midway: the report is still written, with the cases the tier never reached
    listed as not run, and the exit status says that nothing failed (the benchmark's own cap: test_bench)."""
    code, report, printed = gpu_check(tmp_path, "--minutes", "0.4")
    assert code == 0, printed
    tier = report["tier"]
    assert tier["timed_out"] and tier["not_run"] and len(tier["not_run"]) + len(tier["cases"]) > 60
    assert all(c["outcome"] != "failed" for c in tier["cases"])
    assert report["bench"]["rows"] and "stopped at its time cap" in printed


def test_outside_a_checkout_it_says_where_it_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "cp_compile", "gpu-check", "--dry-run", "--root", str(tmp_path), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "runs from a checkout" in done.stdout and "tests/test_cuda.py" in done.stdout
