"""fxckpt/__init__.py: the top level's names, ``fxckpt.distributed`` imported on first use, and
the retired ``fxckpt.Segment`` still answering, with a warning."""

from __future__ import annotations

import importlib

import pytest

import fxckpt


def test_every_name_of_all_is_there() -> None:
    missing = [name for name in fxckpt.__all__ if not hasattr(fxckpt, name)]
    assert not missing and len(set(fxckpt.__all__)) == len(fxckpt.__all__)


def test_distributed_is_the_pipeline_module_imported_on_first_use() -> None:
    assert fxckpt.distributed is importlib.import_module("fxckpt.pipeline.distributed")


def test_segment_is_the_plans_segment_spec_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"^fxckpt.Segment is now fxckpt.SegmentSpec"):
        assert fxckpt.Segment is fxckpt.SegmentSpec


def test_any_other_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'fxckpt' has no attribute 'Segments'$"):
        fxckpt.Segments  # noqa: B018
    assert not hasattr(fxckpt, "planner")
