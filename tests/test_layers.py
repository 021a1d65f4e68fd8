"""The package's folders are its layers: each imports only the layers below it.

Every module under ``asyncsync/`` is parsed with :mod:`ast` (no import runs), each
``import`` / ``from ... import`` of an ``asyncsync`` module (relative ones resolved, imports
inside functions and under ``TYPE_CHECKING`` included) is mapped to its layer, and the
direction is checked against :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncsync"

# The public vocabulary every layer may use: exceptions and statistics rows.
VOCABULARY = {"asyncsync._errors", "asyncsync._stats"}
# Modules on top of everything: they may import any layer and no layer imports them.
TOP = {"asyncsync", "asyncsync.testing", "asyncsync.torchrl", "asyncsync.ray", "asyncsync.soak", "asyncsync._stateful", "asyncsync.bench"}
FOLDERS = {"_core": "core", "_wire": "wire", "_io": "io", "_local": "local", "_dist": "dist", "_schemes": "schemes", "_workers": "workers"}

_ORDER = ["vocabulary", "core", "wire", "io", "local", "dist", "schemes", "workers"]
# Each layer imports only itself and the layers below it; the multi-host transport's relay
# fans out through the local transport, and the schemes build senders over both.
ALLOWED: dict[str, set[str]] = {layer: set(_ORDER[: i + 1]) for i, layer in enumerate(_ORDER)}
ALLOWED["api"] = set(_ORDER)
ALLOWED["top"] = set(_ORDER) | {"api", "top"}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name inside ``asyncsync``; None for an unplaced module."""
    if module in VOCABULARY:
        return "vocabulary"
    if module == "asyncsync":
        return "api"
    parts = module.split(".")
    if ".".join(parts[:2]) in TOP:
        return "top"
    if len(parts) >= 2 and parts[1] in FOLDERS:
        return FOLDERS[parts[1]]
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``asyncsync`` module that ``source`` (the text of ``module``) imports."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            # `from .._io import _queues` imports a module; `from .. import Sender`, a name of the package
            found.update(f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}"))
    return {m for m in found if m == "asyncsync" or m.startswith("asyncsync.")}


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    importer = layer_of(module)
    assert importer is not None, module
    bad = []
    for target in sorted(imported_modules(source, module, is_package)):
        imported = layer_of(target)
        if imported is None or imported not in ALLOWED[importer]:
            bad.append(f"{module} ({importer}) imports {target} ({imported})")
    return bad


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_layer() -> None:
    unplaced = [module_name(p) for p in MODULES if layer_of(module_name(p)) is None]
    assert not unplaced, f"put these in a layer folder (or add them to VOCABULARY/TOP in this test): {unplaced}"


def test_imports_follow_the_layers() -> None:
    bad = []
    for path in MODULES:
        name = module_name(path)
        if layer_of(name) is not None:
            bad += violations(path.read_text(), name, path.name == "__init__.py")
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_back() -> None:
    """No import circle between modules, inside a layer either (``TYPE_CHECKING`` imports count)."""
    graph = {}
    for path in MODULES:
        name = module_name(path)
        graph[name] = {m for m in imported_modules(path.read_text(), name, path.name == "__init__.py") if m != name}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle or [])


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of *graph* (a path that ends where it began), or None. A package's
    ``__init__`` re-exporting its modules is not a circle with them."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt in graph and not state.get(nxt):
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node)
            if found:
                return found
    return None


def test_a_circle_is_caught() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "p": {"p.x"}, "p.x": {"p"}}) is None


@pytest.mark.parametrize(
    "module,source",
    [
        ("asyncsync._core._acks", "from .._local._transport import LocalTransport\n"),
        ("asyncsync._core._options", "from .._local._receiver import Receiver\n"),
        ("asyncsync._local._transport", "from .._schemes._local import MultiProcessWeightSyncScheme\n"),
        ("asyncsync._schemes._local", "from .._workers import spawn_workers\n"),
        ("asyncsync._core._acks", "from .._io import _queues\n"),
        ("asyncsync._wire._codec", "def f():\n    from asyncsync._io._shm import Segment\n"),
        ("asyncsync._io._queues", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._local import _receiver\n"),
        ("asyncsync._local._transport", "from .._dist._relay import Relay\n"),
        ("asyncsync._local._transport", "import asyncsync.testing\n"),
        ("asyncsync._dist._relay", "from .. import MultiProcessWeightSyncScheme\n"),
        ("asyncsync._errors", "from ._workers import WorkerGroup\n"),
        ("asyncsync._errors", "from ._core._options import DEFAULT\n"),
        ("asyncsync._core._acks", "from .._unplaced import x\n"),
        ("asyncsync._io._slots", "from .._local._mailbox import Mailbox\n"),  # the mailbox is the local transport's
        ("asyncsync._local._commit", "from .._dist._relay import Relay\n"),
    ],
)
def test_a_forbidden_import_is_caught(module: str, source: str) -> None:
    assert violations(source, module)


@pytest.mark.parametrize(
    "module,source",
    [
        ("asyncsync._core._acks", "from .._errors import ClosedError\nfrom ._signal import Signal\n"),
        ("asyncsync._wire._messages", "from .._core._layout import Layout\n"),
        ("asyncsync._io._queues", "from .._wire._local import encode\n"),
        ("asyncsync._local._transport", "from .._io._slots import SlotPool\nfrom ._receiver import Receiver\n"),
        ("asyncsync._core._sender", "from ._delivery import Delivery\nfrom ._transport import Transport\n"),
        ("asyncsync._schemes._dist", "from .._dist._relay import Relay\nfrom ._local import MultiProcessWeightSyncScheme\n"),
        ("asyncsync._workers", "from ._schemes._local import MultiProcessWeightSyncScheme\n"),
        ("asyncsync._local._receiver", "from ._bucket import SlotBucket\n"),
        ("asyncsync._dist._relay", "from .._local._transport import LocalTransport\nfrom . import _control\n"),
        ("asyncsync.testing", "from ._schemes._dist import DistributedWeightSyncScheme\n"),
        # the receiver's parts: segments, the one commit path, the polled mailbox
        ("asyncsync._local._receiver", "from ._commit import Committer\nfrom ._slotmap import SlotMap\nfrom ._mailbox import Mailbox\n"),
        ("asyncsync._local._mailbox", "from .._io._shm import Segment\n"),
    ],
)
def test_an_allowed_import_passes(module: str, source: str) -> None:
    assert violations(source, module) == []


def test_the_queue_facade_sits_on_the_pipe_and_the_pipe_on_the_framing() -> None:
    """Inside the local I/O layer: ``_framing`` needs no other I/O module, ``_pipe`` only
    the framing, and neither knows the ``AsyncQueue`` façade above them."""
    io_imports = {}
    for name in ("_framing", "_pipe"):
        module = f"asyncsync._io.{name}"
        found = imported_modules((PACKAGE / "_io" / f"{name}.py").read_text(), module, False)
        io_imports[name] = {m for m in found if m.startswith("asyncsync._io.")}
    assert io_imports == {"_framing": set(), "_pipe": {"asyncsync._io._framing"}}


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder without ``__init__.py`` imports as a namespace package but is left out of the wheel."""
    folders = {p.parent for p in MODULES}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").is_file()) == []
