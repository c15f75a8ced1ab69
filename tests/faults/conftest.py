"""Fault-injection suite (issue 8): shared helpers. The root conftest's ``s3`` fixture applies.

Every test here is marked ``faults``; long ones are also ``slow``.
"""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # the data builders of tests/ (train_data, test_download, ...)
    sys.path.insert(0, str(TESTS))

REPO = TESTS.parent


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_one_error_line(stderr: str, *needles: str) -> str:
    """Exactly one ``error:`` line naming every needle, and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
