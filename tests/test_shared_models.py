"""Repeated blocks found in real graphs (planning/blocks.py) and solved once: on the benchmark's
GPT-2, BERT and Llama-style models the shared plan costs at most 5% more recompute than the full
search's at the same budget, and the planner takes the cheaper of the two."""

from __future__ import annotations

import pytest
import torch

from benchmarks.models import spec_for
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.cost.annotate import info
from fxckpt.planning.blocks import block_of, block_ranges
from fxckpt.cost.bridge import problem_of
from fxckpt.capture.graphs import planned_nodes
from fxckpt.planning.keeps import choices
from fxckpt.solver import simulate
from fxckpt.solver.selective import solve_selective
from fxckpt.solver.shared import families, solve_shared

pytest.importorskip("transformers")


def test_block_of_takes_the_first_numbered_item() -> None:
    assert block_of("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert block_of("layer2.0.downsample.0") == "layer2.0"
    assert block_of("lm_head") is None and block_of("") is None


@pytest.mark.slow
@pytest.mark.parametrize("name, layers", [("gpt2", "transformer.h"), ("bert", "encoder.layer"),
                                          ("llama", "model.layers")])
def test_shared_plans_are_within_5_percent_of_the_full_search(name: str, layers: str) -> None:
    spec = spec_for(name)
    torch.manual_seed(0)
    model, inputs, _ = spec.build(spec.full)
    captured = capture(model, inputs, {})
    annotate(captured.gm, captured.graph_args(inputs, {}))
    order = planned_nodes(captured.gm.graph)
    problem = problem_of(captured.gm)
    blocks = block_ranges(problem, order)
    (family,) = families(problem, blocks)
    assert len(family) == spec.full["layers"]
    position = {op.name: i for i, op in enumerate(problem.ops)}
    for k, (start, end) in enumerate(family):  # each range is exactly one layer's nodes
        paths = {info(n).module_path for n in order if start <= position[n.name] < end}
        assert {block_of(p) for p in paths if p} == {f"{layers}.{k}"}
    offered = choices(problem, order, {})[0]
    eager = simulate(problem, ()).peak_bytes
    for fraction in (0.3, 0.5, 0.75):
        budget = int(fraction * eager)
        shared = solve_shared(problem, budget, blocks, offered)
        full = solve_selective(problem, budget, offered)
        assert shared is not None and shared.predicted_peak <= budget
        assert shared.recompute_cost <= 1.05 * full.recompute_cost, (fraction, shared, full)
