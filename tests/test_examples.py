"""The examples run as their docstrings say (short runs: the long ones are in the README's results)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]'): the example's model")


def test_train_packed_example(tmp_path):
    """A few steps of random packings: the script itself fails on more than 2 compiles, a graph break or a
    step whose fp32 loss is more than 1e-4 (relative) from one process; it writes the plot."""
    plot = tmp_path / "curves.png"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_packed.py"), "--steps", "8", "--inner",
                          "aot_eager", "--plot", str(plot)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CP backend compiled" in run.stdout and "largest relative difference" in run.stdout
    assert plot.stat().st_size > 10_000
