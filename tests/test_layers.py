"""The house reads one way: imports point down `daemon -> engine -> models -> kernels`, `metrics` imports no other
package of ours, no package imports another in a cycle (module level or inside functions), and nothing at run time
imports the benchmarks (`bench`) or the tools (`tools`, which the wheel does not ship). Runtime files stay under
500 lines (the issue 51 bound; STYLE.md: split by concept before that) and runtime functions under 11 parameters.

The graph is read from the source (every `import` statement, wherever it sits), not from what a run happens to
import, so a lazy import inside a function counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lower packages come later; a package may import the ones after it.
RUNTIME = ("daemon", "engine", "models", "kernels")
# Imported by the runtime packages; imports none of ours.
BESIDE = "metrics"
# Above the runtime: they may import it, it never imports them. tools may import bench, not the reverse.
ABOVE = ("tools", "bench")
# The package's own root: `diffusiond/__init__.py` (its version, nothing else) may be imported by anyone;
# `diffusiond/__main__.py` (the command line's entry point: `bench` or the daemon's commands) by no one.
ROOT_MODULES = {"__init__.py": "diffusiond", "__main__.py": "diffusiond.__main__"}
PACKAGES = (*RUNTIME, BESIDE, *ABOVE)
MAX_LINES = 500
MAX_PARAMETERS = 10


def package_of(module: str) -> str | None:
    """`diffusiond.models.families.sd3` -> `models`; the root's own modules -> `diffusiond` / `__main__`; not ours ->
    None."""
    parts = module.split(".")
    if parts[0] != "diffusiond":
        return None
    if len(parts) == 1:
        return "diffusiond"
    return parts[1]


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import in `source`, module-level or not; relative imports resolved against
    `module` (the importing module's dotted name)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from diffusiond import models`: the package models; `from diffusiond import __version__`: the root.
            if target == "diffusiond":
                found += [(node.lineno, f"diffusiond.{a.name}" if a.name in PACKAGES else target) for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["diffusiond", *parts])


def python_files(root: Path) -> list[Path]:
    files = [root / name for name in ROOT_MODULES if (root / name).is_file()]
    for package in (*RUNTIME, BESIDE, *ABOVE):
        files += sorted((root / package).rglob("*.py"))
    return files


def edges(root: Path) -> list[tuple[str, str, str]]:
    """(importer package, imported package, 'file:line module') for every import between two of our packages."""
    out = []
    for path in python_files(root):
        name = module_name(path, root)
        src = package_of(name) if path.parent != root else ("__main__" if path.name == "__main__.py" else "diffusiond")
        for line, target in imported_modules(path.read_text(), name):
            dst = package_of(target)
            if target == "diffusiond.__main__":
                dst = "__main__"
            if dst is None or dst == src:
                continue
            out.append((src, dst, f"{path.relative_to(root)}:{line} {target}"))
    return out


def allowed(src: str, dst: str) -> bool:
    if dst == "diffusiond":
        return True  # the version
    if dst == "__main__":
        return False
    if src == "__main__":
        return True
    if src == BESIDE or src == "diffusiond":
        return False
    if src in ABOVE:
        return dst not in ABOVE or ABOVE.index(dst) > ABOVE.index(src)
    if dst == BESIDE:
        return True
    return dst in RUNTIME and RUNTIME.index(dst) > RUNTIME.index(src)


def violations(found: Iterable[tuple[str, str, str]]) -> list[str]:
    return [f"{src} -> {dst}: {where}" for src, dst, where in found if not allowed(src, dst)]


def cycles(found: Iterable[tuple[str, str, str]]) -> list[list[str]]:
    """Package cycles of the graph (each as the packages around it), by depth-first search."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in found:
        graph.setdefault(src, set()).add(dst)
    seen: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                if sorted(cycle) not in [sorted(c) for c in seen]:
                    seen.append(cycle)
            elif len(path) < len(graph) + 1:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return seen


def test_imports_point_down():
    found = edges(ROOT)
    assert found, "no imports between our packages were found: the checker reads nothing"
    assert not violations(found), "\n".join(violations(found))


def test_no_package_imports_another_in_a_cycle():
    assert not cycles(edges(ROOT)), cycles(edges(ROOT))


def test_runtime_never_imports_the_benchmarks_or_the_tools():
    bad = [where for src, dst, where in edges(ROOT) if src in (*RUNTIME, BESIDE) and dst in ABOVE]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_what_it_must(tmp_path):
    """The checks above on a tree made to break them: an `engine` import in `models/` (inside a function), a
    `kernels` import of `models`, metrics importing the engine, the daemon importing bench lazily."""
    for package in (*RUNTIME, BESIDE, *ABOVE):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "models" / "sd3.py").write_text("def f():\n    from diffusiond.engine.request import RequestStatus\n")
    (tmp_path / "kernels" / "lora.py").write_text("from ..models import sd3\n")
    (tmp_path / "metrics" / "observer.py").write_text("import diffusiond.engine.request\n")
    (tmp_path / "daemon" / "cli.py").write_text("def main():\n    from diffusiond.bench import serve\n")
    (tmp_path / "engine" / "engine.py").write_text(
        "from diffusiond.models import base\nfrom diffusiond import daemon\n"
    )
    (tmp_path / "daemon" / "app.py").write_text(
        "from diffusiond import __version__\nfrom diffusiond.engine import engine\n"
    )
    (tmp_path / "models" / "base.py").write_text("from diffusiond.kernels import lora\n")
    (tmp_path / "bench" / "serve.py").write_text("from diffusiond.daemon import app\n")
    found = edges(tmp_path)
    bad = violations(found)
    expected = ["models -> engine", "kernels -> models", "metrics -> engine", "daemon -> bench", "engine -> daemon"]
    assert sorted(line.split(":")[0] for line in bad) == sorted(expected), bad
    assert sorted(map(sorted, cycles(found))) == [
        ["bench", "daemon"],
        ["daemon", "engine"],
        ["engine", "models"],
        ["kernels", "models"],
    ], cycles(found)


def runtime_files() -> list[Path]:
    return [p for package in (*RUNTIME, BESIDE) for p in sorted((ROOT / package).rglob("*.py"))]


def test_runtime_files_stay_within_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in runtime_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def test_runtime_functions_take_at_most_10_parameters():
    many = []
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and parameters(node) > MAX_PARAMETERS:
                many.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({parameters(node)})")
    assert not many, "\n".join(many)
