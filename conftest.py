"""The README's and docs/' Python blocks run as tests (see tests/doc_examples.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "tests"))

pytest_plugins = ["doc_examples"]
