"""diffusiond: a serving daemon for diffusion models."""

import os
import sys

__version__ = "0.1.0"


def _keep_root_off_path() -> None:
    """Take this source checkout's root off sys.path.

    Its folders are diffusiond.* (pyproject's package-dir), never top-level packages, yet `python -m ...` run from the
    checkout puts the root first on sys.path, and then `import kernels` (which transformers >= 5.25 does on import, for
    the Hub's `kernels` package it now requires) finds our kernels/ folder instead and fails. The same holds for
    `daemon` and `metrics`, also taken names on PyPI. Nothing imports the root's folders by their bare names.
    """
    root = os.path.realpath(os.path.dirname(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]


_keep_root_off_path()
