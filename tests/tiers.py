"""Which tests are slow: the README's command runs the rest (the fast tier) in a few minutes.

A test is *slow* when it took more than about 3 s on the project's 2-core machine (one run of
``pytest --durations=0``, torch 2.13, CPU), listed in ``tests/slow_tests.txt``, or is marked
``@pytest.mark.slow`` where it is written. ``pytest -m slow`` runs them; ``.ci/run`` runs every
tier. The two large case lists keep a representative slice in the fast tier: every Python-fact
pattern with ``every=1`` on the symbolic-trace capture, and the conformance zoo's GPT-2 and
BERT. A new test that takes seconds goes into ``slow_tests.txt`` (its node id, no parameters).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SLOW", "is_slow"]


def _listed(path: Path) -> frozenset[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line)


SLOW = _listed(Path(__file__).with_name("slow_tests.txt"))
"""Test functions (every parameter) in the slow tier."""

_FACTS = "tests/test_python_facts.py::test_same_bits_or_a_named_refusal"
_ZOO = "tests/test_conformance.py::test_same_bits_with_every_strategy_or_the_documented_refusal"


def is_slow(nodeid: str) -> bool:
    """Whether the test with this pytest node id (relative to the repository) is slow."""
    function, _, params = nodeid.partition("[")
    if function == _FACTS:
        return not params.endswith("-every1-symbolic_trace]")
    if function == _ZOO:
        return params not in ("gpt2]", "bert]")
    return function in SLOW
