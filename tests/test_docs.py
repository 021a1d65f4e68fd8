"""The documentation runs: every public name's ``Example::`` and the README's and docs' code blocks.

**Docstring examples.** Every name in ``asyncsync.__all__`` and ``asyncsync.testing.__all__`` must have an ``Example::`` block
(a line starting ``Example`` and ending ``::``, then an indented block) in its docstring,
and every one runs:

- a *snippet* (top-level ``await`` allowed) runs in this process, in a fresh event loop,
  within ``SNIPPET_TIMEOUT`` seconds, in a namespace holding the ``PREAMBLE`` below:
  ``asyncio``, ``torch``, ``nn``, every name of ``asyncsync.__all__`` and ``make_policy()``.
  Workers are ``loopback_worker``\\ s (receivers in the same event loop, no process);
- a *script* (it contains ``if __name__ == "__main__":``) runs as ``python example.py`` would,
  from a file in a temporary directory, within ``SCRIPT_TIMEOUT`` seconds: spawned workers
  must import their function from a file. A script is mostly process start-up (importing
  torch, starting its workers), so they all run, one after another, in one background
  interpreter (tests/_script_runner.py) started when this module's first test starts (the
  ``scripts`` fixture); each test waits for its own, and a script must leave no child
  process running when it returns.

**Markdown code blocks.** Every ```` ```python ```` block of README.md and docs/*.md is
compiled (top-level ``await`` allowed) and every module and name it imports must import
(``from asyncsync import X`` must resolve). A *self-contained* block, whose names are all
defined in it or builtins, runs: as a script if it has a ``__main__`` guard (such a block
needs no other name), else as a snippet, in the ``PREAMBLE`` namespace, so a block that
only needs ``make_policy`` or an asyncsync name also runs. Any other name a block uses must
be a public asyncsync name or one of the ``PLACEHOLDERS`` (``policy``, ``train_step``, ...)
that the docs leave to the reader: a renamed API shows up here as an unknown name.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import asyncsync
import asyncsync.testing

pytest_plugins = ["pytester"]

# Every public name: the package's, and its testing module's (imported explicitly by users).
PUBLIC: dict[str, Any] = {
    **{f"asyncsync.{n}": getattr(asyncsync, n) for n in asyncsync.__all__},
    **{f"asyncsync.testing.{n}": getattr(asyncsync.testing, n) for n in asyncsync.testing.__all__},
}

ROOT = Path(__file__).resolve().parent.parent
SNIPPET_TIMEOUT = 20.0
SCRIPT_TIMEOUT = 120.0  # mostly process start-up: importing torch takes seconds, more on a loaded machine

PREAMBLE = '''
import asyncio

import torch
from torch import nn

from asyncsync import *


def make_policy() -> nn.Module:
    """A tiny policy: the same architecture in the trainer and in every worker."""
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
'''

# Names the docs' fragments use without defining them: the reader's own objects.
PLACEHOLDERS = frozenset(
    {
        # the reader's objects
        "ctx",  # a multiprocessing context
        "env",
        "fn",  # a worker function
        "i",
        "local_policy",
        "main",  # the reader's own coroutine
        "make_model",
        "make_policy",
        "mp",  # import multiprocessing as mp
        "num_workers",
        "optim",
        "policy",
        "scheme",
        "td",  # a TensorDict
        "train_step",
        "worker",
        "worker_idx",
        # defined in another block of the same page
        "env_server",
        "rollout_worker",
    }
)


_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example\b[^\n]*::[ \t]*$", re.MULTILINE)


def example_of(obj: Any) -> str | None:
    """The code of the first ``Example::`` block of *obj*'s own docstring, dedented; None if it has none."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not doc:
        return None
    doc = inspect.cleandoc(doc)
    m = _EXAMPLE.search(doc)
    if m is None:
        return None
    base = len(m.group("indent"))
    lines: list[str] = []
    for line in doc[m.end() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= base:
            break  # the text after the block
        lines.append(line)
    code = textwrap.dedent("\n".join(lines)).strip("\n")
    return code + "\n" if code else None


def is_script(code: str) -> bool:
    return re.search(r"^if __name__ == [\"']__main__[\"']:", code, re.MULTILINE) is not None


def compile_block(code: str, where: str) -> Any:
    return compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def run_snippet(code: str, where: str, namespace: dict[str, Any]) -> None:
    """Run *code* (top-level ``await`` allowed) in *namespace*, in a fresh event loop, bounded."""
    compiled = compile_block(code, where)

    async def main() -> None:
        result = eval(compiled, namespace)
        if inspect.iscoroutine(result):
            await result

    async def bounded() -> None:
        await asyncio.wait_for(main(), SNIPPET_TIMEOUT)

    asyncio.run(bounded())


class Scripts:
    """The script examples, run one after another in one background interpreter (a
    script is mostly process start-up: torch and the forkserver then start once for all),
    in the order the tests ask for them; each test waits for its own script's result."""

    def __init__(self, codes: list[str]) -> None:
        self.codes = list(dict.fromkeys(codes))
        self.tmp = tempfile.TemporaryDirectory(prefix="asyncsync-examples-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.reported: dict[str, threading.Event] = {}
        self._readers: list[threading.Thread] = []

    def start(self) -> None:
        if self.codes:
            self._launch(self.codes)

    def _path(self, code: str) -> Path:
        return Path(self.tmp.name) / f"example_{hashlib.sha1(code.encode()).hexdigest()[:10]}.py"

    def _launch(self, codes: list[str]) -> None:
        """One runner for *codes* (tests/_script_runner.py); a thread collects its results."""
        paths = []
        for code in codes:
            self._path(code).write_text(code)
            self.reported[code] = threading.Event()
            paths.append(str(self._path(code)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        r, w = os.pipe()
        log = Path(self.tmp.name) / f"runner{len(self.procs)}.log"
        try:
            with log.open("w") as out:
                cmd = [sys.executable, "-m", "tests._script_runner", "--timeout", str(SCRIPT_TIMEOUT), str(w), *paths]
                proc = subprocess.Popen(cmd, cwd=self.tmp.name, env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=[w], start_new_session=True)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self.procs.append(proc)
        by_path = dict(zip(paths, codes))
        reader = threading.Thread(target=self._collect, args=(r, by_path, log), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _collect(self, fd: int, by_path: dict[str, str], log: Path) -> None:
        with open(fd) as results:
            for line in results:
                result = json.loads(line)
                code = by_path.pop(result["path"])
                self.results[code] = result
                self.reported[code].set()
        for code in by_path.values():  # the runner ended before it ran them
            self.results[code] = {"ok": False, "error": f"the runner ended first:\n{log.read_text()}", "stdout": ""}
            self.reported[code].set()

    def run(self, code: str) -> str:
        """Wait for *code*'s result (run with the others, or now if it is new); return its stdout."""
        if code not in self.reported:
            self._launch([code])
        # The runner bounds each script by SCRIPT_TIMEOUT, and runs them in the tests' order.
        before = self.codes.index(code) if code in self.codes else 0
        assert self.reported[code].wait((before + 1) * SCRIPT_TIMEOUT + 30), f"no result from the script runner:\n{code}"
        result = self.results[code]
        assert result["ok"], f"example script failed:\n{code}\n--- stdout:\n{result['stdout']}\n--- error:\n{result['error']}"
        return str(result["stdout"])

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the process and the workers it spawned (its own session)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def background_pids(self) -> set[int]:
        """The runners still running and their children."""
        pids: set[int] = set()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    root = psutil.Process(proc.pid)
                    pids |= {proc.pid, *(c.pid for c in root.children(recursive=True))}
                except psutil.NoSuchProcess:
                    pass
        return pids

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:  # deselected, or its test failed early
                self._kill(proc)
            else:
                proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)
        self.tmp.cleanup()


def preamble_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "asyncsync_example"}
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------- docstring examples


def script_codes() -> list[str]:
    """Every script example: from the docstrings, and the self-contained markdown blocks."""
    codes = list(dict.fromkeys(c for c in (example_of(PUBLIC[n]) for n in sorted(PUBLIC)) if c and is_script(c)))  # the tests' order
    codes += [c for _, c in BLOCKS if is_script(c) and not undefined_names(c)]
    return codes


@pytest.fixture(scope="module")
def scripts() -> Iterator[Scripts]:
    runner = Scripts(script_codes())
    runner.start()
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(autouse=True)
def _no_leaked_children(scripts: Scripts) -> Iterator[None]:
    """conftest's check that a test leaves no child process, minus the example scripts
    running in the background (each is waited for by its own test, the rest killed at the end)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    # The scripts' children, looked up on both sides of the snapshot: a script that ends
    # right after it would otherwise leave its exiting worker looking like ours.
    background = scripts.background_pids()
    now = psutil.Process().children(recursive=True)
    background |= scripts.background_pids()
    left = [
        p
        for p in now
        if p.pid not in before
        and p.pid not in background
        and p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert not left, f"child processes left behind: {[(p.pid, p.name()) for p in left]}"


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_has_an_example_that_runs(name: str, scripts: Scripts) -> None:
    code = example_of(PUBLIC[name])
    assert code is not None, f"{name} has no `Example::` block in its docstring"
    where = f"<example of {name}>"
    if is_script(code):
        scripts.run(code)
    else:
        run_snippet(code, where, preamble_namespace())


def test_examples_are_found_and_classified() -> None:
    class Documented:
        """Text.

        Example (a detail)::

            x = 1

            print(x)

        More text.
        """

    assert example_of(Documented) == "x = 1\n\nprint(x)\n"
    assert example_of(lambda: None) is None
    assert is_script('def f():\n    pass\n\nif __name__ == "__main__":\n    f()\n')
    assert not is_script("await asyncio.sleep(0)\n")


# ---------------------------------------------------------------- markdown code blocks

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL)


def markdown_blocks() -> list[tuple[str, str]]:
    """``(id, code)`` of every ```` ```python ```` block of README.md and docs/*.md."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            code = textwrap.dedent(m.group("code"))
            blocks.append((f"{path.relative_to(ROOT)}:{line}", code))
    return blocks


def undefined_names(code: str) -> set[str]:
    """Names *code* reads that it never binds anywhere (scopes merged) and that are no builtins."""
    tree = ast.parse(code)
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound - set(dir(builtins))


# Optional packages: a block importing one (e.g. docs/torchrl-migration.md's torchrl block) is
# checked where it is installed (CI's second pass installs torchrl), skipped elsewhere.
OPTIONAL = frozenset({"torchrl"})


def missing_optional(code: str) -> list[str]:
    tops = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
            if node.module == "asyncsync.torchrl":
                tops.add("torchrl")
    return sorted(m for m in tops & OPTIONAL if importlib.util.find_spec(m) is None)


def check_imports(code: str, where: str) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    raise AssertionError(f"{where}: `from {node.module} import {alias.name}`: no such name") from None


BLOCKS = markdown_blocks()


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_markdown_code_block_is_current(where: str, code: str, scripts: Scripts) -> None:
    compile_block(code, where)
    missing = missing_optional(code)
    if missing:
        pytest.skip(f"{where} needs {', '.join(missing)}, not installed here")
    check_imports(code, where)
    unknown = undefined_names(code)
    if is_script(code) and not unknown:
        scripts.run(code)
        return
    namespace = preamble_namespace()
    if not is_script(code) and unknown <= namespace.keys():
        run_snippet(code, where, namespace)
        return
    stale = unknown - PLACEHOLDERS - set(asyncsync.__all__)
    assert not stale, (
        f"{where} uses {sorted(stale)}: not public asyncsync names; import them, define them, or add them to PLACEHOLDERS"
    )


def test_markdown_blocks_are_found() -> None:
    wheres = [w for w, _ in BLOCKS]
    assert any(w.startswith("README.md:") for w in wheres)
    assert undefined_names("import os\nx = os.getpid()\nprint(y)\n") == {"y"}


def test_reference_lists_every_public_name() -> None:
    listed = re.findall(r"^::: asyncsync\.(\w+)$", (ROOT / "docs" / "reference.md").read_text(), re.MULTILINE)
    assert sorted(listed) == sorted(asyncsync.__all__), (
        "docs/reference.md needs one `::: asyncsync.Name` per name of asyncsync.__all__"
    )


# ---------------------------------------------------------------- the error tree

_TREE_LINE = re.compile(r"^(?P<prefix>(?:│   |    )*)(?P<branch>[├└]── )?(?P<name>[A-Z]\w*)\b(?P<rest>.*)$")


def drawn_tree(text: str) -> list[tuple[str, str | None, str]]:
    """``(class, drawn parent, the rest of the line)`` for every line of the first error tree
    drawn in *text* (a root line ``AsyncSyncError`` followed by ``├──`` lines)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "AsyncSyncError")
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries: list[tuple[str, str | None, str]] = []
    stack: list[str] = []
    for line in lines[start:]:
        m = _TREE_LINE.match(line[indent:]) if not line[:indent].strip() else None
        if m is None or (entries and not m.group("branch")):
            break
        depth = len(m.group("prefix")) // 4 + (1 if m.group("branch") else 0)
        del stack[depth:]
        entries.append((m.group("name"), stack[-1] if stack else None, m.group("rest")))
        stack.append(m.group("name"))
    return entries


def error_classes() -> list[tuple[str, str | None]]:
    """``(class, asyncsync parent)`` for AsyncSyncError and every public asyncsync subclass."""
    found: list[tuple[str, str | None]] = [("AsyncSyncError", None)]

    def walk(cls: type) -> None:
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("asyncsync") and not sub.__name__.startswith("_"):
                found.append((sub.__name__, cls.__name__))
                walk(sub)

    walk(asyncsync.AsyncSyncError)
    return found


def test_error_tree_is_drawn_once_in_the_docs() -> None:
    drawn = [p.name for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if "├── " in p.read_text()]
    assert drawn == ["reference.md"], f"the error tree belongs in docs/reference.md only, found in {drawn}"


@pytest.mark.parametrize("where", ["docs/reference.md", "the errors module's docstring"])
def test_drawn_error_tree_matches_the_classes(where: str) -> None:
    if where.endswith(".md"):
        text = (ROOT / where).read_text()
    else:
        text = sys.modules[asyncsync.AsyncSyncError.__module__].__doc__ or ""
        if "AsyncSyncError\n" not in text:
            pytest.skip("the errors module's docstring draws no tree (docs/reference.md's is checked)")
    entries = drawn_tree(text)
    assert sorted((name, parent) for name, parent, _ in entries) == sorted(error_classes()), (
        f"the error tree in {where} differs from the classes' hierarchy"
    )
    for name, _, rest in entries:
        cls = getattr(asyncsync, name)
        assert name in asyncsync.__all__
        for also in re.findall(r"also `{0,2}(\w+)", rest):
            assert issubclass(cls, getattr(builtins, also)), f"{where}: {name} is drawn as also {also}"


def test_drawn_tree_parser() -> None:
    text = "x\n\n    AsyncSyncError\n    ├── A    a\n    │   └── B    b (also ValueError)\n    └── C\n\nmore\n"
    assert drawn_tree(text) == [
        ("AsyncSyncError", None, ""),
        ("A", "AsyncSyncError", "    a"),
        ("B", "A", "    b (also ValueError)"),
        ("C", "AsyncSyncError", ""),
    ]


# ---------------------------------------------------------------- written for users

USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]


def test_every_install_command_pins_torch() -> None:
    """An unpinned ``pip install`` of the project pulls torch's multi-GB CUDA build."""
    unpinned = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in USER_DOCS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"pip install\b[^`\n]*?(-e\s+['\"]?[.\w/]|\btorch\b|\btorchrl\b)", line) and "torch==" not in line
    ]
    assert not unpinned, "pin torch==2.13.0 in: " + "; ".join(unpinned)


def test_docs_hold_no_project_history_or_machine_paths() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissue\s*#?\d+|\bthis session\b|/work/|/home/\w", line, re.IGNORECASE)
    ]
    assert not found, "docs speak to users (history goes to CHANGELOG.md): " + "; ".join(found)


# ---------------------------------------------------------------- docs/testing.md as a new project

_TESTING_FILE = re.compile(r"\A# (?P<path>tests/test_\w+\.py)\b")
_TOML_FENCE = re.compile(r"^```toml[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def reader_project() -> dict[str, str]:
    """``{relative path: text}``: docs/testing.md's ``pyproject.toml`` snippet and its test
    files (the blocks that start with a ``# tests/test_x.py`` line), as a new project has them."""
    text = (ROOT / "docs" / "testing.md").read_text()
    files = {"pyproject.toml": "".join(m.group("code") for m in _TOML_FENCE.finditer(text))}
    for where, code in BLOCKS:
        if where.startswith("docs/testing.md:") and "def test_" in code:
            m = _TESTING_FILE.match(code)
            assert m, f"{where}: a test file of testing.md starts with a `# tests/test_x.py` line"
            files[m.group("path")] = code
    return files


def test_testing_md_is_a_project() -> None:
    files = reader_project()
    assert 'asyncio_mode = "auto"' in files["pyproject.toml"]
    assert {"tests/test_loop.py", "tests/test_worker.py", "tests/test_rollouts.py"} <= files.keys()


@pytest.mark.timeout(SCRIPT_TIMEOUT + 60)
def test_testing_md_snippets_pass_in_a_new_project(pytester: pytest.Pytester) -> None:
    """The reader's view: a project holding only testing.md's pyproject.toml and test files,
    asyncsync installed; pytest run there (in this interpreter, as ``python -m pytest``
    would: its own configuration, plugins from their entry points; its worker processes
    come from this process's forkserver) passes every test."""
    files = reader_project()
    for rel, code in files.items():
        (pytester.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / rel).write_text(code)
    expected = sum(len(re.findall(r"^async def test_|^def test_", code, re.MULTILINE)) for code in files.values())
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    report = "\n".join(result.outlines)
    assert result.ret == 0 and re.search(rf"\b{expected} passed\b", report), report
