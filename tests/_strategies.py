"""Hypothesis strategies shared by the tests.

``st.text()`` with its default alphabet makes hypothesis build (and cache in ``.hypothesis/``)
an interval set of all of Unicode first: tens of seconds on a fresh clone. These alphabets
are plain code-point ranges, cheap to build on a cold cache, and still cover every UTF-8
length: 1-byte (ASCII), 2-, 3- and 4-byte characters; no surrogates (they do not encode).
"""

from __future__ import annotations

from hypothesis import strategies as st

UTF8_CHARS = st.one_of(
    st.characters(min_codepoint=0x00, max_codepoint=0x7F),
    st.characters(min_codepoint=0x80, max_codepoint=0x7FF),
    st.characters(min_codepoint=0x800, max_codepoint=0xD7FF),
    st.characters(min_codepoint=0xE000, max_codepoint=0xFFFF),
    st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF),
)


def texts(*, min_size: int = 0, max_size: int | None = None) -> st.SearchStrategy[str]:
    """``st.text`` over :data:`UTF8_CHARS`."""
    return st.text(alphabet=UTF8_CHARS, min_size=min_size, max_size=max_size)
