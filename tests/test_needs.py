"""Tests that stop running say so: a test missing a package or a mount that .ci/run provides fails under CI instead
of skipping (tests/needs.py), and every skip goes through that rule, but the GPU's (CI has none)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from needs import missing

TESTS = Path(__file__).resolve().parent
# Skips CI cannot turn into failures: what no CI machine here has.
HARDWARE = re.compile(r"torch\.cuda\.is_available\(\)")


def test_every_skip_goes_through_needs():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "needs.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pytest\.(skip\(|mark\.skipif|importorskip)", line) and not HARDWARE.search(line):
                found.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
    assert not found, "skips that CI would not notice (use needs.missing):\n" + "\n".join(found)


def test_missing_is_a_failure_under_ci_and_a_skip_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="haproxy"):
        missing("needs haproxy")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="haproxy"):
        missing("needs haproxy")
