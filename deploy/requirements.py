"""What the image's deps stage installs (Dockerfile): diffusiond's dependencies and those of the extras named in
argv[1] (comma-separated), read from pyproject.toml, one requirement a line. torch and torchvision are left out:
the image installs them first, from its TORCH argument, as a pair that imports together (PyPI's torchvision wheels
require one exact torch, a CUDA build)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

LEFT_OUT = {"torch", "torchvision"}


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    known = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in known]
    if unknown:
        raise SystemExit(f"unknown extras {', '.join(unknown)}; pyproject.toml has: {', '.join(sorted(known))}")
    wanted = list(project["dependencies"]) + [r for e in extras for r in known[e]]
    out: list[str] = []
    for requirement in wanted:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()
        if name not in LEFT_OUT and requirement not in out:
            out.append(requirement)
    return out


if __name__ == "__main__":
    extras = [e.strip() for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e.strip()]
    print("\n".join(requirements(Path(__file__).resolve().parent.parent / "pyproject.toml", extras)))
