"""Which tests are slow: the README's command runs the rest (the fast tier) in a few minutes.

A test is *slow* when it took more than about 2 s on the project's 2-core machine (one run of
``pytest --durations=0``, torch 2.13, CPU), listed in ``tests/slow_tests.txt``, or is marked
``@pytest.mark.slow`` where it is written. ``pytest -m slow`` runs them; ``.ci/run`` runs every
tier. A new test that takes seconds goes into ``slow_tests.txt`` (its node id, no parameters).

The two large case lists keep a representative slice in the fast tier, chosen here:

- Python facts (``tests/test_python_facts.py``): every pattern with ``every=1`` on the
  symbolic-trace capture, and the patterns of ``FACTS_EVERYWHERE`` with every strategy on both
  captures (a guarded attribute, random draws, a no_grad region).
- Conformance zoo (``tests/test_conformance.py``): the cases of ``ZOO_FAST``, one per model family
  (but three) and one documented refusal.
- Through Dynamo (``tests/dynamo/test_dynamo_facts.py``): every pattern of
  ``tests/dynamo_patterns.py`` with ``every=1``, and the ``FACTS_EVERYWHERE`` patterns under a
  budget every graph fits; the Python-fact harness through Dynamo is slow.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SLOW", "FACTS_EVERYWHERE", "ZOO_FAST", "is_slow"]


def _listed(path: Path) -> frozenset[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line)


SLOW = _listed(Path(__file__).with_name("slow_tests.txt"))
"""Test functions (every parameter) in the slow tier."""

FACTS_EVERYWHERE = frozenset({
    "temperature_changed",  # a guarded Python attribute changed between steps: a new capture
    "stochastic_depth_tensors",  # random draws replayed (symbolic_trace refuses it, by name)
    "no_grad_island",  # a grad-mode region kept inside the graph
})
"""Python-fact patterns run with every strategy on both captures in the fast tier."""

ZOO_FAST = frozenset({
    "gpt2",  # decoder-lm
    "bert",  # encoder
    "resnet_bn",  # vision-cnn
    "vit",  # vision-transformer
    "hubert_stable_ln",  # speech
    "lora_llama",  # lora
    "wav2vec2_ctc_labels",  # a documented refusal
})
"""Conformance cases in the fast tier: one per model family and a refusal. The encoder-decoder,
MoE and vision-language families run in the slow tier only: their cheapest cases (marian,
qwen2_moe_shared or olmoe, clip) take 7-9 s each here, and the fast tier must stay under five
minutes on the project's machine."""

_FACTS = "tests/test_python_facts.py::test_same_bits_or_a_named_refusal"
_DYNAMO = ("tests/dynamo/test_dynamo_facts.py::"
           "test_python_around_the_tensors_trains_to_the_same_bits")
_DYNAMO_HARNESS = "tests/dynamo/test_dynamo_facts.py::test_the_python_fact_harness_through_dynamo"
_DYNAMO_FITS = ("tests/dynamo/test_dynamo_facts.py::"
                "test_a_budget_each_graph_fits_recomputes_nothing")
_ZOO = "tests/test_conformance.py::test_same_bits_with_every_strategy_or_the_documented_refusal"


def is_slow(nodeid: str) -> bool:
    """Whether the test with this pytest node id (relative to the repository) is slow."""
    function, _, params = nodeid.partition("[")
    if function == _FACTS:  # [case-strategy-capture]
        case, strategy, capture = params.rstrip("]").rsplit("-", 2)
        everywhere = case in FACTS_EVERYWHERE
        return not (everywhere or (strategy == "every1" and capture == "symbolic_trace"))
    if function == _ZOO:  # [case]
        return params.rstrip("]") not in ZOO_FAST
    if function == _DYNAMO:  # [case-strategy]: every1 in the fast tier
        return not params.rstrip("]").endswith("-every1")
    if function == _DYNAMO_HARNESS:  # the Python-fact harness through Dynamo: slow
        return True
    if function == _DYNAMO_FITS:  # [case]: the FACTS_EVERYWHERE cases in the fast tier
        return params.rstrip("]") not in FACTS_EVERYWHERE
    return function in SLOW
