"""What a test needs from the machine (a Debian package, a mount): under CI (`CI` set, as .ci/run sets it) a missing
one is a failure, since .ci/run installs them all and a silent skip would hide a test that stopped running; on a
developer's machine it is a skip that says what to install."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    """The test cannot run here: `reason` says what it needs (and what installs it)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it (.ci/run), so this is a failure, not a skip")
    pytest.skip(reason)
