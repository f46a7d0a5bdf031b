"""Collectives inside the model (CFG-parallel gathers, Ulysses all-to-alls) fail as a group, never per request."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from diffusiond.engine.comm import CommError


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """A failed collective breaks the group (a rank died, or ranks disagree), whichever request it ran for: it
    surfaces as CommError, which stops the engine instead of failing one request."""
    try:
        yield
    except CommError:
        raise
    except Exception as exc:
        raise CommError(f"{what} failed: {exc}") from exc
