"""``asyncsync.bench`` uses the public API only, and its modules import each other without a circle.

Every module under ``asyncsync/bench/`` is parsed with :mod:`ast` (no import runs; imports
inside functions count), as in tests/test_layers.py. Developer tools that look inside the
library live in ``scripts/`` instead (``scripts/bench_profile.py``).
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.test_layers import PACKAGE, _is_module, imported_modules, module_name

BENCH = PACKAGE / "bench"
#: What the bench may import from asyncsync, besides its own modules.
PUBLIC = {"asyncsync", "asyncsync.testing", "asyncsync.torchrl", "asyncsync.ray"}
MODULES = sorted(BENCH.rglob("*.py"))


def _is_bench(module: str) -> bool:
    return module == "asyncsync.bench" or module.startswith("asyncsync.bench.")


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The asyncsync modules that *source* (the text of *module*) imports and may not."""
    return sorted(m for m in imported_modules(source, module, is_package) if m not in PUBLIC and not _is_bench(m))


def bench_imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """The bench modules that *module* imports. ``from asyncsync.bench import _cpu`` imports
    the submodule only (its package is initialised anyway); a name of the package (``from
    asyncsync.bench import run_benchmark``) imports the package. A module re-entering
    itself (``python -m`` of a module that imports its own name) is not counted."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            submodules = {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return {m for m in found if _is_bench(m) and m != module}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of *graph* (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def test_the_bench_imports_only_public_modules() -> None:
    bad = []
    for path in MODULES:
        name = module_name(path)
        bad += [f"{name} imports {target}" for target in private_imports(path.read_text(), name, path.name == "__init__.py")]
    assert not bad, "the bench uses the public API only (or the tool goes to scripts/):\n" + "\n".join(bad)


def test_the_bench_names_no_private_module() -> None:
    """What ``grep -rn 'asyncsync\\._' asyncsync/bench`` finds: also in strings and docstrings."""
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in MODULES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"asyncsync\._", line)
    ]
    assert not hits, "\n".join(hits)


def test_the_bench_has_no_import_circle() -> None:
    graph = {module_name(p): bench_imports(p.read_text(), module_name(p), p.name == "__init__.py") for p in MODULES}
    assert "asyncsync.bench._poll" in graph and graph["asyncsync.bench._run"]  # the walk found the modules
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle or [])


@pytest.mark.parametrize(
    "source",
    [
        "from asyncsync._io._pipe import FramedPipe\n",
        "def f():\n    from asyncsync._local import _poll\n",
        "import asyncsync._core._ownership\n",
        "from asyncsync import _stateful\n",
        "from .. import _errors\n",
        "from asyncsync.soak import main\n",
    ],
)
def test_a_private_import_is_caught(source: str) -> None:
    assert private_imports(source, "asyncsync.bench._run")


@pytest.mark.parametrize(
    "source",
    [
        "from asyncsync import AsyncQueue, spawn_workers\n",
        "import asyncsync.testing\n",
        "from asyncsync.bench._worker import bench_worker\n",
        "from . import _cpu\n",
        "import torch\n",
    ],
)
def test_a_public_import_passes(source: str) -> None:
    assert not private_imports(source, "asyncsync.bench._run")


def test_a_circle_is_caught() -> None:
    poll = bench_imports("def f():\n    from asyncsync.bench._run import worker_report\n", "asyncsync.bench._poll")
    run = bench_imports("from asyncsync.bench._poll import poll_worker\nfrom asyncsync.bench import _cpu\n", "asyncsync.bench._run")
    assert poll == {"asyncsync.bench._run"} and run == {"asyncsync.bench._poll", "asyncsync.bench._cpu"}
    assert find_circle({"asyncsync.bench._poll": poll, "asyncsync.bench._run": run}) is not None
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
