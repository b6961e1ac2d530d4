"""A pytest plugin that writes each test's outcome as one JSON line, as soon as the test ends.

``python -m pytest -p cp_compile.tools.case_log`` with ``CP_COMPILE_CASE_LOG=FILE``: a run stopped by a
time cap still leaves the cases it finished, which is what ``gpu-check`` needs on a machine lent for
minutes. The first line lists every collected case, so the cases a stopped run never reached are known.
Each case's line carries the errors it measured against the error rule (the test's ``user_properties``
named ``"error"``: what, CP error, single-device error).
"""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    with open(os.environ["CP_COMPILE_CASE_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: why")
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = report.longreprtext.strip().splitlines()
    failures = [line for line in text if line.startswith("E ")]
    return "\n".join((failures or text)[-6:])


def pytest_runtest_logreport(report) -> None:
    # a case ends at its call, or earlier where its setup skipped or failed; a failed teardown is its own line
    if report.when == "call" or not report.passed:
        _write(
            {
                "case": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "seconds": round(report.duration, 3),
                "reason": "" if report.passed else _reason(report),
                "errors": [value for name, value in report.user_properties if name == "error"],
            }
        )
