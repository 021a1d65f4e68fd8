"""Hypothesis strategies shared by the tests.

``st.text()`` and ``st.characters()`` make hypothesis build (and cache in ``.hypothesis/``) a
table of all of Unicode first: tens of seconds for ``st.text()`` on a fresh clone, before a
single example. These strategies draw code points as integers (nothing to build) and still
cover every UTF-8 length: 1-byte (ASCII), 2-, 3- and 4-byte characters; no surrogates
(they do not encode).
"""

from __future__ import annotations

from hypothesis import strategies as st

# Code points drawn as integers: st.characters() would build hypothesis's Unicode table first.
UTF8_CHARS = st.one_of(
    st.integers(0x00, 0x7F),  # 1 byte
    st.integers(0x80, 0x7FF),  # 2 bytes
    st.integers(0x800, 0xD7FF),  # 3 bytes (below the surrogates)
    st.integers(0xE000, 0xFFFF),  # 3 bytes
    st.integers(0x10000, 0x10FFFF),  # 4 bytes
).map(chr)


def texts(*, min_size: int = 0, max_size: int | None = None) -> st.SearchStrategy[str]:
    """Strings of :data:`UTF8_CHARS`, as ``st.text`` would draw them."""
    return st.lists(UTF8_CHARS, min_size=min_size, max_size=max_size).map("".join)
