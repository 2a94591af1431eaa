"""Retired names stay retired: a word the glossary (docs/design.md) gave one meaning is not
brought back under its old name in code.

Each entry maps an identifier that was renamed to the name that replaced it. The scan reads
Python tokens (names only: prose in docstrings and comments may still say "range").
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RETIRED = {
    "to_ranges": "to_spans",  # the glossary's span: a segment as the solver sees it
    "ranges_of": "spans_of",
    "predict_ranges": "predict_spans",
    "Range": "Span",
    "StateGuard": "Traceless",  # a guard is a Python fact checked before every call
    "state_guard": "traceless",
    "graph_view": "bridge (the module) or labelled_graph (the picture's graph)",
    # select: costs -> Plan; place: a strategy's segments; solve: the solver's search
    "choose": "place (a strategy's segments) or plan_at (fit's callback)",
    "Chosen": "Placement",
    "Choose": "PlanAt",
    "choose_actions": "decide_actions",
    "signature_key": "variant_key",  # a signature is text for people; keys are matched
    "integration": "frameworks (the marker of tests/frameworks: integrations/ is fxckpt's code)",
}


def names_in(source: str) -> set[str]:
    return {tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME}


def test_the_scan_sees_names_and_not_prose() -> None:
    assert names_in('x = to_ranges(p)  # ranges_of\n"""Range"""\n') == {"x", "to_ranges", "p"}


def test_no_retired_name_comes_back() -> None:
    found = []
    for folder in ("fxckpt", "tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for name in names_in(path.read_text(encoding="utf-8")) & set(RETIRED):
                found.append(f"{path.relative_to(REPO)}: {name} (now {RETIRED[name]})")
    assert not found, "\n".join(found)
