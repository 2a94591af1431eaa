"""The test tiers: every test the slow list names exists, and the case lists keep a fast slice."""

from __future__ import annotations

from pathlib import Path

from tiers import SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_slow_test_exists() -> None:
    missing = []
    for nodeid in sorted(SLOW):
        path, _, function = nodeid.partition("::")
        source = (ROOT / path).read_text(encoding="utf-8") if (ROOT / path).is_file() else ""
        if f"def {function.split('::')[-1]}(" not in source:
            missing.append(nodeid)
    assert len(SLOW) > 50 and not missing, missing


def test_the_case_lists_keep_a_fast_slice() -> None:
    facts = "tests/test_python_facts.py::test_same_bits_or_a_named_refusal"
    zoo = "tests/test_conformance.py::test_same_bits_with_every_strategy_or_the_documented_refusal"
    assert not is_slow(f"{facts}[module_counter-every1-symbolic_trace]")
    assert is_slow(f"{facts}[module_counter-every1-export]")
    assert is_slow(f"{facts}[module_counter-budget-symbolic_trace]")
    assert not is_slow(f"{zoo}[gpt2]") and is_slow(f"{zoo}[t5]")
    demo = "tests/test_demo.py::test_demo_quick_runs_and_checkpointing_lowers_measured_memory"
    assert is_slow(demo)
    assert not is_slow("tests/test_plan.py::test_anything_not_listed")
