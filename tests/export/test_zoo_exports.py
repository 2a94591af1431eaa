"""Every model of the conformance zoo that ``save`` accepts loads under the closed allowlist and
the memory bound, and trains to the same bits as the transformed module it was saved from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import fxckpt
from support import assert_steps_equal, run_step
from zoo import ZOO, ZooCase

UNSAVED = {
    "qwen2_moe_shared": "torch.ops.transformers.grouped_mm_fallback",
    "mixtral_moe": "torch.ops.transformers.grouped_mm_fallback",
    "olmoe": "torch.ops.transformers.grouped_mm_fallback",
    "bloom_alibi": "BloomGelu, not one of the torch.nn module classes",
    "sew_d": "torch.export could not swap them back",
}
"""Zoo models save refuses (an operator or module class of the model's own package), or that
capture refuses already (SEW-D, tests/test_conformance.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", ZOO, ids=[c.name for c in ZOO])
def test_a_zoo_models_export_loads_and_trains_like_the_model(case: ZooCase,
                                                              tmp_path: Path) -> None:
    torch.manual_seed(1)
    args, kwargs = case.inputs()
    tm = fxckpt.transform(case.make(), depth=case.depth, capture="graph")  # what save holds
    reference = fxckpt.transform(case.make(), depth=case.depth,
                                 capture="graph")  # the same weights, its own
    if case.name in UNSAVED:
        with pytest.raises(fxckpt.FxckptError, match=UNSAVED[case.name]):
            run_step(tm, args, kwargs)
            fxckpt.save(tm, tmp_path / "e")
        return
    run_step(tm, args, kwargs)  # a training call plans the graph the export holds
    run_step(reference, args, kwargs)
    reference.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="this export uses")  # off the allowlist: none
        fxckpt.save(tm, tmp_path / "e")
    loaded = fxckpt.load(tmp_path / "e")
    for step in range(1, 3):
        got = run_step(loaded, args, kwargs, seed=step)
        for key in [k for k in got.buffers if k.startswith("_fxckpt_constants.")]:
            del got.buffers[key]  # graph constants the loaded module registers as its own
        assert_steps_equal(got, run_step(reference, args, kwargs, seed=step))
        loaded.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
