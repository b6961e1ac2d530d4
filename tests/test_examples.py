"""The examples run as their docstrings say (short runs: the long ones are in docs/results.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.launches

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the example's model")


def test_train_packed_example(tmp_path):
    """A few steps of random packings: the script itself fails on more than 2 compiles, a graph break or a
    step whose fp32 loss is more than 1e-4 (relative) from one process; it writes the plot."""
    plot = tmp_path / "curves.png"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_packed.py"),
            "--steps",
            "5",
            "--inner",
            "aot_eager",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CP backend compiled" in run.stdout and "largest relative difference" in run.stdout
    assert plot.stat().st_size > 10_000


def test_generate_batch_command():
    """``python -m cp_compile generate-batch`` on a small model with a window layer: the rows' tokens match one
    process's (it exits 1 otherwise), and each rank holds less K/V than one process."""
    args = ["-C", "2", "-P", "40,1,17", "--new", "6", "--arch", "qwen2", "--hidden", "64", "--layers", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "cp_compile", "generate-batch", *args, "--window", "8"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    row = run.stdout.strip().splitlines()[-1].split()
    assert row[:2] == ["2", "True"], run.stdout
    assert float(row[4]) < float(row[6]), run.stdout  # K/V per rank against one process's (MB)


def test_scale_command(tmp_path):
    """``python -m cp_compile scale`` on a short sequence: a row per C, the activations each rank saves at C = 2 below
    one process's, BLOOM's route through the schedules."""
    import json

    out = tmp_path / "scale.json"
    run = subprocess.run(
        [sys.executable, "-m", "cp_compile", "scale", "--families", "bloom", "-L", "256", "-C", "2"]
        + ["--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["family"], r["C"]) for r in rows] == [("bloom", c) for c in (0, 1, 2)], rows
    assert all("error" not in r for r in rows), rows
    assert all(r["saved_ratio"] < 0.7 for r in rows if r["C"] == 2), rows
    assert "ALiBi as one more key dimension" in rows[-1]["route"], rows[-1]


def test_generate_command(tmp_path):
    """``python -m cp_compile generate`` on a small model: it exits 1 if any token differs from one process."""
    out, plot = tmp_path / "rows.json", tmp_path / "generate.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cp_compile",
            "generate",
            "--arch",
            "qwen2",
            "-C",
            "2",
            "-P",
            "9,33",
            "--new",
            "8",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--window",
            "8",
            "--out",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())
    assert [r["prompt"] for r in rows] == [9, 33] and all(r["same_tokens"] for r in rows)
    assert plot.stat().st_size > 10_000


def test_step_command(tmp_path):
    """``python -m cp_compile step`` at a small size: the loss is one process's, and the all-gather schedule makes
    3 collectives per layer (K and V together), one agreement per graph and one gradient all-reduce per step."""
    out = tmp_path / "step.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cp_compile",
            "step",
            "-L",
            "64",
            "--schedules",
            "allgather",
            "--inner",
            "aot_eager",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--hidden",
            "64",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    (row,) = json.loads(out.read_text())
    assert row["loss_rel_err"] < 1e-5 and row["cp_ms"] > 0 and row["one_ms"] > 0
    assert row["costs"]["collectives"] == 2 * 3 + 1 + 1, row["costs"]
    assert row["sites"] == ["allgather: chosen by the plan (schedule=...)"]


def test_accuracy_command(tmp_path):
    """``python -m cp_compile accuracy`` at a small size: every schedule within the gates, JSON and PNG written."""
    out, plot = tmp_path / "accuracy.json", tmp_path / "accuracy.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cp_compile",
            "accuracy",
            "-C",
            "1,2",
            "-S",
            "96",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--out",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())
    assert [r["C"] for r in rows] == [1, 2]
    assert all(r[s]["ratio"] <= 2 and r[s]["fp64"] < 1e-10 for r in rows for s in ("ring", "allgather", "ulysses"))
    assert plot.stat().st_size > 10_000
