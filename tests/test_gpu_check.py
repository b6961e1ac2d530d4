"""``python -m cp_compile gpu-check --dry-run``: the GPU check's cases on the CPU, as a lent GPU machine runs
them (a subprocess from the checkout, one JSON report), and its time cap."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run_of(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cp_compile", "gpu-check", "--dry-run", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    done = dry_run_of(out)
    return done.returncode, json.loads((out / "gpu-check.json").read_text()), done.stdout


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
    """A tier the cap stops midway (a checkout whose GPU tier has a fast case and one that outlasts the cap): the
    finished case is reported with its measured errors, the other as not run, and the report says the cap
    stopped it."""
    from cp_compile.tools import gpu_check

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "import pytest\n\n"
        "@pytest.hookimpl(wrapper=True)\n"
        "def pytest_runtest_call(item):\n"
        "    result = yield\n"
        "    item.user_properties.append(('error', ('out', 1.0, 1.0)))\n"
        "    return result\n"
    )
    (tmp_path / "tests" / "test_cuda.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_outlasts_the_cap():\n    time.sleep(120)\n"
    )
    (tmp_path / "tests" / "test_triton_merge.py").write_text("def test_after():\n    pass\n")
    tier = gpu_check.run_tier(tmp_path, tmp_path, 15.0)
    assert tier["timed_out"] and tier["seconds"] < 60
    assert [(c["case"], c["outcome"], c["errors"]) for c in tier["cases"]] == [
        ("tests/test_cuda.py::test_fast", "passed", [["out", 1.0, 1.0]])
    ]
    assert tier["not_run"] == ["tests/test_cuda.py::test_outlasts_the_cap", "tests/test_triton_merge.py::test_after"]
    report = {
        "dry_run": True,
        "meta": gpu_check.environment("cpu"),
        "tier": tier,
        "bench": {"seconds": 0.0, "rows": [], "error": None},
    }
    report["summary"] = gpu_check.summarize(report)
    assert report["summary"]["not_run"] == 2 and report["summary"]["worst_error_ratio"] == 1.0
    assert "stopped at its time cap" in gpu_check.render(report)
    assert not (tmp_path / "cases.jsonl").exists() and not (tmp_path / "tier.log").exists()  # one report file


def test_outside_a_checkout_it_says_where_it_runs(tmp_path):
    done = dry_run_of(tmp_path, "--root", str(tmp_path))
    assert done.returncode == 2 and "runs from a checkout" in done.stdout and "tests/test_cuda.py" in done.stdout
