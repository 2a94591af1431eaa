"""export/rebuild.py: the load side of an export, module trees rebuilt from their entries:
names checked part by part, a segment's typed fields (and the graph attributes older exports
kept them in)."""

from __future__ import annotations

import pytest

from fxckpt.export import ExportError
from fxckpt.export.codec import encode
from fxckpt.export.rebuild import _segment_fields, check_name


@pytest.mark.parametrize("name", ["layers.0.attn", "fc1", "0"])
def test_dotted_names_of_plain_parts_pass(name: str) -> None:
    assert check_name(name, "structure.json: a module path") == name


@pytest.mark.parametrize("name", ["layers..0", "__class__", "a.__dict__", "a b", 3, None, ""])
def test_other_names_are_refused_naming_the_place(name: object) -> None:
    with pytest.raises(ExportError, match="^structure.json: a module path: .* is not a name an "
                                          "export may use$"):
        check_name(name, "structure.json: a module path")


def test_exports_that_kept_segment_fields_as_graph_attributes_still_load() -> None:
    legacy = {"program": "programs/v0/segment_0.json", "attrs": {
        "_fxckpt_name": encode("segment_0", "name"),
        "_fxckpt_restores": encode(("bn.running_mean",), "restores")}}
    # none kept; early stop on
    assert _segment_fields(legacy) == dict(name="segment_0", restores=("bn.running_mean",),
                                           kept=0, early_stop=True, draws=True)
    assert _segment_fields({"program": "p", "attrs": {}}) is None
    with pytest.raises(ExportError, match="a graph module has no saved attribute 'code'"):
        _segment_fields({"program": "p", "attrs": {"code": "x"}})
    with pytest.raises(ExportError, match="a segment needs a name and a list of buffers"):
        _segment_fields({"program": "p", "attrs": {}, "segment": ["segment_0"]})
    with pytest.raises(ExportError, match="is not a name an export may use"):
        _segment_fields({"program": "p", "attrs": {},
                         "segment": {"name": "s", "restores": ["a b"]}})


def test_a_segments_kept_count_must_be_a_non_negative_int() -> None:
    entry = {"program": "p", "attrs": {}, "segment": {"name": "segment_0", "restores": []}}
    fields = dict(name="segment_0", restores=(), kept=0, early_stop=True, draws=True)
    assert _segment_fields({**entry, "segment": {**entry["segment"], "kept": 3}}) == {
        **fields, "kept": 3}
    for bad in (-1, "2", True, 1.5):
        with pytest.raises(ExportError, match="kept count must be an int >= 0"):
            _segment_fields({**entry, "segment": {**entry["segment"], "kept": bad}})
    for flag in ("early_stop", "draws"):
        assert _segment_fields({**entry, "segment": {**entry["segment"], flag: False}}) == {
            **fields, flag: False}
        for bad in (0, "no", None):
            with pytest.raises(ExportError, match=f"{flag} must be true or false"):
                _segment_fields({**entry, "segment": {**entry["segment"], flag: bad}})
