"""A griffe extension for the API reference (mkdocs.yml loads it): docstrings written for
``help()`` read well on the site too.

- An ``Example::`` block (a line starting ``Example`` and ending ``::``, then an indented
  block; tests/test_docs.py runs every one) becomes a bold title and a fenced Python block.
- Sphinx roles (``:class:`X```, ``:meth:`x```, ...) become inline code.
- Signatures of the public API show no private names: a private constant used as a
  default shows its value (``timeout=_DEFAULT`` reads ``timeout=...``), a private import
  its own name (``_MPQueue`` reads ``Queue``), a private module or class in front of a
  public name is dropped (``_options.DEFAULT`` reads ``DEFAULT``), and so is a private
  type in a union annotation (``float | _Default`` reads ``float``). Anything private left
  is a warning, which fails ``mkdocs build --strict``. A class's bases show only classes
  users import (not asyncsync's internal ones).
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Iterator
from typing import Any

import griffe

_logger = logging.getLogger("mkdocs.plugins.griffe_examples")

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


# a private name standing alone (not after a dot), and private prefixes of a dotted name
_PRIVATE_NAME = re.compile(r"(?<![\w.])_[A-Za-z]\w*")
_PRIVATE_PREFIX = re.compile(r"(?<![\w.])(?:_[A-Za-z]\w*\.)+(?=[A-Za-z])")
_PRIVATE_UNION_MEMBER = re.compile(r"\s*\|\s*_[A-Za-z]\w*(?![\w.\[])|(?<![\w.])_[A-Za-z]\w*\s*\|\s*")


def private_names(text: str) -> list[str]:
    """The private names that *text* (a default or an annotation) still shows."""
    return _PRIVATE_NAME.findall(re.sub(r"(['\"]).*?\1", "", text))  # not inside string literals


def public_objects(pkg: griffe.Module) -> Iterator[griffe.Class | griffe.Function | griffe.Attribute]:
    """Every class, function, method and attribute the reference renders: the ``__all__`` names of
    *pkg* and of its public submodules, their public members with a docstring and
    ``__init__`` (merged into its class's signature), recursively."""
    seen: set[str] = set()

    def walk(obj: griffe.Object | griffe.Alias) -> Iterator[griffe.Class | griffe.Function | griffe.Attribute]:
        if obj.is_alias:
            try:
                obj = obj.final_target  # type: ignore[union-attr]
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return
        if obj.path in seen:
            return
        seen.add(obj.path)
        if (obj.is_function or obj.is_attribute) and (obj.docstring or obj.name == "__init__"):
            yield obj  # type: ignore[misc]  # rendered: show_if_no_docstring is off
        elif obj.is_class:
            yield obj  # type: ignore[misc]
            for name, member in obj.members.items():
                if not name.startswith("_") or name == "__init__":
                    yield from walk(member)

    modules = [pkg, *(m for n, m in pkg.modules.items() if not n.startswith("_"))]
    for module in modules:
        for name in module.exports or ():
            member = module.members.get(str(name))
            if member is not None:
                yield from walk(member)


def readable(obj: griffe.Object, text: str, *, value: bool) -> str:
    """*text* (a default or value if *value*, else an annotation of *obj*) as the reference shows it:
    a private import under its own name, a private constant's value (defaults only), no
    private prefixes; in an annotation, no private member of a union."""

    def public(m: re.Match[str]) -> str:
        name = m.group(0)
        target = obj.module.members.get(name)
        if target is None:
            return name
        if target.is_alias:  # `from x import Queue as _Queue`
            own = target.target_path.rsplit(".", 1)[-1]
            return name if own.startswith("_") else own
        constant = getattr(target, "value", None) if value else None
        return name if constant is None or private_names(str(constant)) else str(constant)

    text = _PRIVATE_NAME.sub(public, _PRIVATE_PREFIX.sub("", text))
    return text if value else _PRIVATE_UNION_MEMBER.sub("", text)


_NAME = re.compile(r"(?<![\w.'\"])[A-Za-z]\w*(?![\w'\"])")
_DROP = "\x00"


def expand_aliases(module: griffe.Module, text: str, public: set[str], depth: int = 3) -> str:
    """*text*, an annotation written in *module*, with asyncsync's own type aliases that users
    cannot import spelled out (``Commit`` reads ``Literal['swap', 'copy']``), and such
    classes left out of a union (``float | None | UseDefault`` reads ``float | None``)."""

    def expand(m: re.Match[str]) -> str:
        name = m.group(0)
        target = module.members.get(name)
        if target is None:
            return name
        try:
            final = target.final_target if target.is_alias else target  # type: ignore[union-attr]
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return name
        if not final.path.startswith("asyncsync.") or final.path in public:
            return name
        if final.is_class:
            return _DROP + name + _DROP
        alias_value = getattr(final, "value", None) if final.is_attribute else None
        if alias_value is None or depth == 0:
            return name
        return expand_aliases(final.module, str(alias_value), public, depth - 1)

    text = _NAME.sub(expand, text)
    text = re.sub(rf"\s*\|\s*{_DROP}\w+{_DROP}|{_DROP}\w+{_DROP}\s*\|\s*", "", text)
    return text.replace(_DROP, "")


def exported(pkg: griffe.Module) -> set[str]:
    """Where the names users import are defined: ``__all__`` of *pkg* and of its public
    submodules, aliases followed."""
    paths: set[str] = set()
    for module in [pkg, *(m for n, m in pkg.modules.items() if not n.startswith("_"))]:
        for name in module.exports or ():
            member = module.members.get(str(name))
            if member is None:
                continue
            try:
                paths.add(member.final_target.path if member.is_alias else member.path)  # type: ignore[union-attr]
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                pass
    return paths


def shown_base(base: Any, public: set[str]) -> bool:
    """Whether the reference shows *base*, a class's base: not when it is asyncsync's own
    implementation (a class no user imports: a private helper, a core shared by two classes)."""
    head = base.left if isinstance(base, griffe.ExprSubscript) else base
    path = head.canonical_path if isinstance(head, griffe.Expr) and hasattr(head, "canonical_path") else str(head)
    if path.startswith("asyncsync."):
        return path in public
    return not private_names(str(head))


class ExampleBlocks(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`rewrite`, and the public API's
    signatures without private names."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = exported(pkg)
        for obj in public_objects(pkg):
            if isinstance(obj, griffe.Class):
                obj.bases = [b for b in obj.bases if shown_base(b, public)]
                continue
            if isinstance(obj, griffe.Function):
                shown = [(f"default of parameter {p.name!r}", p, "default", True) for p in obj.parameters]
                shown += [(f"annotation of parameter {p.name!r}", p, "annotation", False) for p in obj.parameters]
                shown.append(("return annotation", obj, "returns", False))
            else:
                shown = [("value", obj, "value", True), ("annotation", obj, "annotation", False)]
            for what, holder, field, value in shown:
                text = getattr(holder, field)
                if text is None:
                    continue
                if not value:
                    expanded = expand_aliases(obj.module, str(text), public)
                    if expanded != str(text):
                        setattr(holder, field, text := expanded)
                if not private_names(str(text)):
                    continue
                text = readable(obj, str(text), value=value)
                setattr(holder, field, text)
                if private_names(text):
                    _logger.warning(
                        "%s: the %s shows private names %s: make them public, or document the value instead",
                        obj.path,
                        what,
                        private_names(text),
                    )
