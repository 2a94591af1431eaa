"""The test tiers: every test the slow list names exists, and the case lists keep a fast slice."""

from __future__ import annotations

from pathlib import Path

from tiers import FACTS_EVERYWHERE, SLOW, ZOO_FAST, is_slow

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
    assert not is_slow(f"{facts}[temperature_changed-budget_whole-export]")
    assert not is_slow(f"{zoo}[gpt2]") and is_slow(f"{zoo}[t5]")
    demo = "tests/cli/test_demo.py::test_demo_quick_runs_and_checkpointing_lowers_measured_memory"
    assert is_slow(demo)
    assert not is_slow("tests/test_plan.py::test_anything_not_listed")


SLOW_FAMILIES = {"encoder-decoder", "moe-lm", "vision-language"}
"""Zoo families whose every case costs 7 s or more: the slow tier runs them (tiers.ZOO_FAST)."""


def test_the_fast_slices_name_cases_that_exist_one_per_zoo_family() -> None:
    from python_patterns import CASES
    from torch_nn_patterns import NN_CASES
    from zoo import HAZARDS, ZOO

    assert FACTS_EVERYWHERE <= {c.name for c in CASES + NN_CASES}
    assert ZOO_FAST <= {c.name for c in ZOO + HAZARDS}
    fast = {c.family for c in ZOO if c.name in ZOO_FAST}
    assert fast == {c.family for c in ZOO} - SLOW_FAMILIES and SLOW_FAMILIES <= {
        c.family for c in ZOO}  # one case each, but the costliest families


def test_the_case_lists_carry_no_slow_mark_of_their_own() -> None:
    """A ``@pytest.mark.slow`` on the function itself would put its fast slice in the slow tier."""
    import test_conformance
    import test_python_facts

    facts = test_python_facts.test_same_bits_or_a_named_refusal
    zoo = test_conformance.test_same_bits_with_every_strategy_or_the_documented_refusal
    for function in (facts, zoo):
        assert "slow" not in {m.name for m in getattr(function, "pytestmark", [])}, function
