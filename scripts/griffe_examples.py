"""A griffe extension for the API reference (mkdocs.yml loads it): docstrings written for
``help()`` read well on the site too.

- An ``Example::`` block (a line starting ``Example`` and ending ``::``, then an indented
  block; tests/test_docs.py runs every one) becomes a bold title and a fenced Python block.
- Sphinx roles (``:class:`X```, ``:meth:`x```, ...) become inline code.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example\b(?P<detail>[^\n]*?)::[ \t]*$")
_ROLE = re.compile(r":(?:class|meth|func|attr|exc|mod|data|obj):`~?\.?([^`]+)`")


def rewrite(doc: str) -> str:
    """*doc* with its ``Example::`` blocks fenced and its Sphinx roles as inline code."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _EXAMPLE.match(lines[i])
        if m is None:
            out.append(_ROLE.sub(r"`\1`", lines[i]))
            i += 1
            continue
        base = len(m.group("indent"))
        block: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > base):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        code = textwrap.dedent("\n".join(block)).strip("\n")
        indent = m.group("indent")
        detail = m.group("detail").strip()
        out += [f"{indent}**Example**{' ' + detail if detail else ''}", "", f"{indent}```python"]
        out += [indent + line if line else "" for line in code.splitlines()]
        out += [f"{indent}```", ""]
    return "\n".join(out)


class ExampleBlocks(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`rewrite`."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
