"""A run of the slow tests (``python -m pytest -m slow``: minutes per test) names every test
as it starts and ends, as ``-v`` does (tests/conftest.py), instead of a dot per finished test."""

from __future__ import annotations

import pytest

from tests.conftest import selects_slow

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(60)


def test_which_mark_expressions_select_the_slow_tests() -> None:
    assert selects_slow("slow") and selects_slow("slow or ray") and selects_slow("ray and slow")
    assert not selects_slow("not slow and not ray") and not selects_slow("") and not selects_slow("slowish")


@pytest.mark.parametrize(("args", "verbose"), [(["-m", "slow"], True), (["-m", "not slow"], False), (["-m", "slow", "-q"], False)])
def test_a_slow_run_names_each_test(pytester: pytest.Pytester, args: list[str], verbose: bool) -> None:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    slow: a long test\n")
    pytester.makeconftest("from tests.conftest import pytest_configure  # the suite's own hook\n")
    pytester.makepyfile(test_long="import pytest\n\n@pytest.mark.slow\ndef test_long():\n    pass\n\ndef test_short():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncsync", *args)
    assert result.ret == 0
    named = [line for line in result.outlines if "test_long.py::" in line and "PASSED" in line]
    assert bool(named) == verbose, "\n".join(result.outlines)
