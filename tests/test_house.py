"""The house's rules, read from the sources (docs/architecture.md, "The layers"): imports go one way between
rooms, no source file grows past 450 lines (the tests' included), neither the engine nor the protocol clients
import Ray, and no test module imports another (what tests share lives in support modules and conftest.py).

A room is a subpackage or a top-level module of lingbot/, deployments/, perf/ or cluster/ (lingbot.io,
lingbot.config, deployments.session, perf.soak, ...); a package's own __init__.py is the room of the
package itself. Every import counts, at the top of a module or inside a function (a lazy import that
dodges a cycle is still a cycle), relative ones resolved against the importing file's package.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS_OF = ("lingbot", "deployments", "perf", "cluster")      # the packages whose rooms must not form a cycle
SIZED = ("lingbot", "deployments", "perf", "tests")            # the packages held to MAX_LINES per file
MAX_LINES = 450
NO_RAY = ("lingbot", "deployments/client")                     # the engine, and a client of the protocols


@dataclass(frozen=True)
class Arrow:
    """One import from room `source` to room `target`, where it is written."""
    source: str
    target: str
    path: str                   # relative to the tree's root
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


def python_files(root: Path, folder: str) -> list[Path]:
    return sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def module_of(root: Path, path: Path) -> str:
    """lingbot/io/weights.py -> lingbot.io.weights; lingbot/io/__init__.py -> lingbot.io."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str, packages: tuple[str, ...]) -> str | None:
    """A module's room: its top package and the next name (lingbot.io.weights -> lingbot.io); None for a
    module outside `packages` (torch, ray, tests)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in packages else None


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(module, line) for every import anywhere in `tree` (function bodies too): `import a.b` names a.b;
    `from a import b` names a.b where that is a module of ours, else a; `from ..x import y` is resolved
    against the file's package (a package's __init__ is its own package)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            for alias in node.names:
                child = f"{stem}.{alias.name}"
                found.append((child if child in known else stem, node.lineno))
    return found


def import_arrows(root: Path, packages: tuple[str, ...] = ROOMS_OF) -> list[Arrow]:
    """Every import between two different rooms of `packages` under `root`."""
    files = [p for package in packages if (root / package).is_dir() for p in python_files(root, package)]
    known = {module_of(root, p) for p in files}
    arrows = set()                                     # `from x import a, b`: one arrow
    for path in files:
        module = module_of(root, path)
        source = room_of(module, packages)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line in imported_modules(tree, module, path.name == "__init__.py", known):
            target = room_of(name, packages)
            if target is not None and target != source:
                arrows.add(Arrow(source, target, str(path.relative_to(root)), line))
    return sorted(arrows, key=lambda a: (a.source, a.target, a.path, a.line))


def cycles(arrows: list[Arrow]) -> list[str]:
    """The strongly connected groups of more than one room (Tarjan), each as 'cycle: rooms | its arrows'."""
    out_of: dict[str, set[str]] = defaultdict(set)
    for a in arrows:
        out_of[a.source].add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        on_stack.add(room)
        for nxt in sorted(out_of[room]):
            if nxt not in index:
                visit(nxt)
                low[room] = min(low[room], low[nxt])
            elif nxt in on_stack:
                low[room] = min(low[room], index[nxt])
        if low[room] == index[room]:                       # the root of a group: pop it whole
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == room:
                    break
            if len(group) > 1:
                groups.append(group)

    for room in sorted(set(out_of) | {a.target for a in arrows}):
        if room not in index:
            visit(room)
    return [f"cycle: {', '.join(sorted(group))} | "
            + "; ".join(str(a) for a in arrows if a.source in group and a.target in group)
            for group in sorted(groups, key=sorted)]


def test_imports_go_one_way_between_rooms():
    found = cycles(import_arrows(ROOT))
    assert not found, "\n".join(found)


def test_a_cycle_is_named_with_its_lines_whether_the_import_is_relative_or_in_a_function(tmp_path):
    """The check itself, on a tree made for it: `b.low` imports `b.high` inside a function, `b.high`
    imports `b.low` relatively; `b.mid` only imports `b.low` and is in no cycle."""
    (tmp_path / "b" / "high").mkdir(parents=True)
    (tmp_path / "b" / "low").mkdir()
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "b" / "high" / "__init__.py").write_text("from .view import show\n")
    (tmp_path / "b" / "high" / "view.py").write_text("import os\n\nfrom ..low.rows import row, row as again\n")
    (tmp_path / "b" / "low" / "__init__.py").write_text("")
    (tmp_path / "b" / "low" / "rows.py").write_text("def row():\n    from b import high\n    return high\n")
    (tmp_path / "b" / "mid.py").write_text("from b.low import rows\n")
    arrows = import_arrows(tmp_path, ("b",))
    assert list(map(str, arrows)) == ["b.high -> b.low (b/high/view.py:3)", "b.low -> b.high (b/low/rows.py:2)",
                                        "b.mid -> b.low (b/mid.py:1)"]
    assert cycles(arrows) == ["cycle: b.high, b.low | b.high -> b.low (b/high/view.py:3); "
                              "b.low -> b.high (b/low/rows.py:2)"]


def test_no_source_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for package in SIZED for p in python_files(ROOT, package)
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines (split by concern): {long}"


def imports_of_test_modules(root: Path) -> list[tuple[str, str, int]]:
    """(importing file, imported test module, line) for every import of a test module (a `test_*.py` under
    tests/) by another file there, in functions too; support modules and conftest.py are not test modules."""
    files = python_files(root, "tests")
    known = {module_of(root, p) for p in files}
    found = []
    for path in files:
        module = module_of(root, path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line in imported_modules(tree, module, path.name == "__init__.py", known):
            if name in known and name != module and name.rsplit(".", 1)[-1].startswith("test_"):
                found.append((str(path.relative_to(root)), name, line))
    return sorted(set(found))


def test_no_test_module_imports_another():
    imports = [f"{path}:{line} imports {name}" for path, name, line in imports_of_test_modules(ROOT)]
    assert imports == [], "move what they share to a support module or conftest.py:\n" + "\n".join(imports)


def test_a_test_module_importing_another_is_named_wherever_the_import_is(tmp_path):
    """The check itself, on a tree made for it: imports of a test module at the top, inside a function and as a
    name of its package are found; of a support module or conftest.py, and a module's own name, are not."""
    (tmp_path / "tests" / "a").mkdir(parents=True)
    for name, text in [("tests/__init__.py", ""), ("tests/conftest.py", ""), ("tests/a/__init__.py", ""),
                       ("tests/a/support.py", "from tests.a.test_x import y\n"),
                       ("tests/a/test_x.py", "import os\n\nfrom tests.a import support\nfrom tests import conftest\n"),
                       ("tests/a/test_y.py", "from tests.a.test_x import y\n\n\ndef f():\n    import tests.a.test_x\n"),
                       ("tests/a/test_z.py", "from tests.a import test_y, support\n")]:
        (tmp_path / name).write_text(text)
    assert imports_of_test_modules(tmp_path) == [("tests/a/support.py", "tests.a.test_x", 1),
                                             ("tests/a/test_y.py", "tests.a.test_x", 1),
                                             ("tests/a/test_y.py", "tests.a.test_x", 5),
                                             ("tests/a/test_z.py", "tests.a.test_y", 1)]


def test_the_engine_and_the_clients_import_no_ray():
    """No `import ray` anywhere in lingbot/ or deployments/client/ (in functions too), and importing every
    module of both in a fresh interpreter leaves Ray unloaded (nothing they import brings it in)."""
    written = []
    for folder in NO_RAY:
        for path in python_files(ROOT, folder):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                written += [f"{path.relative_to(ROOT)}:{node.lineno}" for name in names
                            if name == "ray" or name.startswith("ray.")]
    assert written == []
    script = ("import importlib, pkgutil, sys\n"
              "import deployments.client, lingbot\n"
              "for package in (lingbot, deployments.client):\n"
              "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
              "        if not m.name.endswith('__main__'):\n"
              "            importlib.import_module(m.name)\n"
              "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
