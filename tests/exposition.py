"""Prometheus' text exposition in tests: its samples by name, and the Prometheus tools CI installs.

On the test path through `pythonpath = ["tests"]` in pyproject.toml: `from exposition import ...`.
"""

from __future__ import annotations

import os
import shutil

import pytest


def need(tool: str) -> str:
    """CI installs Debian's prometheus package (.ci/run); on a developer machine without it, skip."""
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed; .ci/run should have installed Debian's prometheus package")
        pytest.skip(f"{tool} not installed (apt-get install prometheus)")
    return path


def samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
