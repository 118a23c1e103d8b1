"""tests/mutations.py's list still describes this tree: each bug's text occurs exactly once where
it says and its tests exist, so `python tests/mutations.py` makes the bugs it names (running them
is `make mutate`, minutes, outside `make test`)."""

import pytest

from tests.mutations import MUTATIONS, ROOT, apply, source_of


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_each_bug_applies_once_and_names_tests_that_exist(m):
    text = (ROOT / m.path).read_text()
    mutated = apply(text, m)  # raises unless m.old occurs exactly once (in m.function)
    assert mutated != text and m.old != m.new
    assert m.tests, f"{m.name} names no test"
    for test in m.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), test
        function = name.split("[")[0]
        assert f"def {function}(" in (ROOT / path).read_text(), test


def test_bug_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))


def test_source_of_a_function_ends_at_the_next_top_level_statement():
    text = "x = 1\n\n\ndef f(\n    a,\n):\n    return a\n\n\n# next\ndef g():\n    pass\n"
    start, end = source_of(text, "f")
    assert text[start:end] == "def f(\n    a,\n):\n    return a\n\n\n"
