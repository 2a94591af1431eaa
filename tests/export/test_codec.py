"""export/codec.py: plain values and pytree specs as tagged JSON data, decoded without importing
or calling anything: round trips, and what is refused on either side."""

from __future__ import annotations

import json
import math
from collections import OrderedDict, defaultdict

import pytest
import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fxckpt.export.codec import ExportError, Unencodable, decode, dump_spec, encode, load_spec

VALUES = [None, True, 3, "a", 1.5, (1, 2), [1, (2, "b")], slice(1, None, 2), Ellipsis,
          torch.Size([2, 3]), {"k": [torch.float16]}, torch.device("cpu"),
          torch.channels_last, torch.strided, torch.bfloat16]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_round_trip_through_json(value: object) -> None:
    data = json.loads(json.dumps(encode(value, "x")))
    back = decode(data)
    assert back == value and type(back) is type(value)


def test_tags_name_values_by_their_short_names() -> None:
    assert encode(torch.float32, "x") == {"__dtype__": "float32"}
    assert encode((1, torch.device("cpu")), "x") == {"__tuple__": [1, {"__device__": "cpu"}]}
    assert encode({"a": None}, "x") == {"__dict__": {"a": None}}
    assert encode(float("-inf"), "x") == {"__float__": "-inf"}


def test_non_finite_floats_round_trip() -> None:
    assert decode(encode(float("inf"), "x")) == math.inf
    assert math.isnan(decode(encode(float("nan"), "x")))


def test_sets_and_functions_round_trip_outside_graphs_only() -> None:
    assert decode(encode({3, 1}, "x")) == {1, 3}
    assert decode(encode(F.relu, "activation")) is F.relu
    node = {"x": object()}
    for data in (encode({1}, "x"), encode(F.relu, "x")):
        with pytest.raises(ExportError, match="unknown tagged value"):
            decode(data, node)


def test_graph_nodes_are_named_and_resolved() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    assert encode([x, 1], "args", nodes=lambda n: n.name) == [{"__node__": "x"}, 1]
    assert decode({"__node__": "x"}, {"x": x}) is x
    with pytest.raises(ExportError, match="refers to node 'y' before"):
        decode({"__node__": "y"}, {"x": x})
    with pytest.raises(ExportError, match="refers to node 'x' before"):
        decode({"__node__": "x"})


@pytest.mark.parametrize("value, message", [
    (object(), "^attrs holds a object"),
    ({1: 2}, "^attrs holds a dict"),
    (lambda x: x, "^attrs holds the function <function"),
    (OrderedDict.fromkeys("a").keys(), "which an export cannot store$"),
])
def test_what_an_export_cannot_store_is_refused_naming_where(value, message: str) -> None:
    with pytest.raises(Unencodable, match=message):
        encode(value, "attrs")


@pytest.mark.parametrize("data, message", [
    ({"a": 1, "b": 2}, "not tagged data"),
    ({"__pickle__": "x"}, "unknown tagged value '__pickle__'"),
    ({"__dtype__": "evil"}, "evil"),
    ({"__slice__": [1, 2]}, "malformed slice"),
    ({"__tuple__": "ab"}, "malformed sequence"),
    ({"__dict__": [1]}, "malformed mapping"),
    ({"__float__": "1e999"}, "malformed float '1e999'"),
    ({"__device__": 3}, "malformed device"),
    ({"__device__": "gpu:x"}, "invalid device 'gpu:x'"),
    ({"__function__": "os.system"}, "os.system"),
])
def test_data_that_is_not_a_value_is_refused(data: object, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        decode(data)


def test_specs_round_trip() -> None:
    spec = pytree.tree_structure(((1, [2]), {"a": OrderedDict(b=3), "s": torch.Size([1])}))
    assert load_spec(dump_spec(spec, "inputs"), "inputs") == spec


def test_a_defaultdict_spec_is_refused_on_either_side() -> None:
    """Its context names the factory's module, which torch's reader would import."""
    spec = pytree.tree_structure(defaultdict(list, a=1))
    with pytest.raises(ExportError, match="^outputs: the pytree structure is not valid$"):
        dump_spec(spec, "outputs")
    with pytest.raises(ExportError, match="^outputs: the pytree structure is not valid$"):
        load_spec(pytree.treespec_dumps(spec), "outputs")


@pytest.mark.parametrize("text, message", [
    ("not json", "^inputs: the pytree structure is not valid$"),
    ('[2, {"type": null, "context": null, "children_spec": []}]', "unknown pytree format '2'"),
    ('[1, {"type": null}]', "^inputs: the pytree structure is not valid$"),
    ('[1, {"type": "builtins.dict", "context": "{\\"a\\": 1}", "children_spec": []}]',
     "a pytree context holds a JSON object"),
    ('[1, {"type": "builtins.eval", "context": "null", "children_spec": []}]',
     "^inputs uses the pytree node type 'builtins.eval'; an export holds only tuples"),
])
def test_malformed_spec_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        load_spec(text, "inputs")
