"""signature.py: what a captured graph is specialised to (the call key), how non-tensor values
are keyed or refused, shapes and their order, and binding calls to ``forward``'s parameters."""

from __future__ import annotations

import enum

import pytest
import torch

from fxckpt.errors import InputError
from fxckpt.signature import (Binder, call_key, describe_signature, dominates, first_tensor,
                              has_hooks, is_compiled, is_static_value, module_states, shapes_of,
                              variant_key, value_key)


class Colour(enum.Enum):
    RED = 1


def test_module_states_are_the_mode_and_hooks_of_every_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    model[1].eval()
    model[0].register_forward_hook(lambda *a: None)
    assert module_states(model) == ((True, False, False), (True, True, False),
                                    (False, False, False))
    assert has_hooks(model[0]) and not has_hooks(model)


@pytest.mark.slow  # torch.compile (Dynamo's first import and setup: about 1.5 s)
def test_a_submodule_compiled_on_its_own_is_in_the_key_and_the_root_is_not() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    model[0].compile()  # sets the compiled call; nothing compiles until a call
    assert is_compiled(model[0]) and not is_compiled(model[1])
    assert module_states(model)[1] == (True, False, True)
    model.compile()
    assert is_compiled(model) and module_states(model)[0] == (True, False, False)


def test_the_call_key_holds_tensor_metadata_and_values_but_not_shapes() -> None:
    states = ((True, False, False),)
    key, shapes = call_key(states, (torch.ones(2, 3),), {"mask": None, "scale": 0.5})
    other, other_shapes = call_key(states, (torch.ones(5, 7),), {"mask": None, "scale": 0.5})
    assert key == other and shapes == ((2, 3),) and other_shapes == ((5, 7),)
    assert key.leaves[0] == (torch.Tensor, torch.float32, torch.device("cpu"), 2, False)
    assert call_key(states, (torch.ones(2, 3),), {"mask": None, "scale": 0.25})[0] != key
    assert call_key(states, (torch.ones(2, 3, 1),), {"mask": None, "scale": 0.5})[0] != key
    assert call_key(((False, False, False),), (torch.ones(2, 3),),
                    {"mask": None, "scale": 0.5})[0] != key


def test_the_default_dtype_is_in_the_key() -> None:
    key = call_key((), (), {})[0]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert call_key((), (), {})[0] != key
    finally:
        torch.set_default_dtype(before)


def test_floats_are_keyed_by_their_bits() -> None:
    assert value_key(0.0) != value_key(-0.0)
    assert value_key(float("nan")) == value_key(float("nan"))
    assert value_key(1) != value_key(1.0) and value_key(True) != value_key(1)
    assert value_key(complex(1, -0.0)) != value_key(complex(1, 0.0))


def test_plain_values_tuples_sets_and_functions_are_keyed() -> None:
    assert value_key((1, "a", None)) == value_key((1, "a", None))
    assert value_key(torch.Size([2, 3])) == (torch.Size, (2, 3))
    assert value_key(frozenset({1, 2})) == (frozenset, frozenset({1, 2}))
    assert value_key(Colour.RED) == (Colour, Colour.RED)
    assert value_key(torch.relu) == ("object", torch.relu)
    assert value_key(Colour) == ("object", Colour)


@pytest.mark.parametrize("value, kind", [([1, 2], "list"), ({"a": 1}, "dict"),
                                         ((1, [2]), "tuple"), (object(), "object")])
def test_mutable_objects_are_refused_naming_where_they_are(value, kind: str) -> None:
    with pytest.raises(InputError, match=f"^keyword argument 'config' is a {kind} object"):
        value_key(value, lambda: "keyword argument 'config'")


def test_the_refusal_names_the_argument_of_the_call() -> None:
    with pytest.raises(InputError, match="^positional argument 1 is a SimpleNamespace object"):
        call_key((), (torch.ones(1), __import__("types").SimpleNamespace(a=1)), {})
    with pytest.raises(InputError, match="^keyword argument 'cfg' is a object object"):
        call_key((), (torch.ones(1),), {"mask": None, "cfg": object()})


def test_a_long_repr_is_cut_short_in_the_message() -> None:
    class Long:
        def __repr__(self) -> str:
            return "x" * 100

    with pytest.raises(InputError, match=r"\(x{57}\.\.\.\)"):
        value_key(Long())


def test_the_signature_key_of_exports_includes_shapes_and_the_mode() -> None:
    key = variant_key(True, (torch.ones(2, 3),), {"flag": True})
    assert key == variant_key(True, (torch.zeros(2, 3),), {"flag": True})
    assert key != variant_key(True, (torch.ones(4, 3),), {"flag": True})
    assert key != variant_key(False, (torch.ones(2, 3),), {"flag": True})
    assert key[2] == (("tensor", (2, 3), torch.float32, "cpu", None), ("value", "bool",
                                                                       (bool, True)))


def test_shapes_in_leaf_order_and_which_shapes_fit_in_others() -> None:
    shapes = shapes_of((torch.ones(2, 3), [torch.ones(4)]), {"m": torch.ones(1), "n": None})
    assert shapes == ((2, 3), (4,), (1,))
    assert dominates(((4, 3), (5,)), ((2, 3), (5,)))
    assert not dominates(((4, 3), (5,)), ((2, 4), (5,)))
    assert not dominates(((4, 3),), ((4,),)) and not dominates(((4,),), ((4,), (1,)))


def test_describe_signature() -> None:
    text = describe_signature((torch.ones(8, 64, dtype=torch.bfloat16), [1, (2,)]),
                              {"mask": None, "extra": {"k": torch.ones(2)}})
    assert text == "(bfloat16[8, 64], [1, (2)], mask=None, extra={'k': float32[2]})"


def test_static_values_and_the_first_tensor() -> None:
    assert is_static_value((1, [None, "a"])) and not is_static_value({"a": [torch.ones(1)]})
    t = torch.ones(1)
    assert first_tensor((1, [t]), {"b": torch.zeros(1)}) is t
    assert first_tensor((1,), {}) is None


def _forward(x, y=2, *, z=3):
    return x


def test_the_binder_fills_defaults_and_names_every_parameter() -> None:
    binder = Binder(_forward)
    assert binder.simple
    assert binder.bind((1,), {}) == {"x": 1, "y": 2, "z": 3}
    assert binder.bind((1, 5), {"z": 6}) == {"x": 1, "y": 5, "z": 6}
    assert binder.bind((), {"x": 1}) == {"x": 1, "y": 2, "z": 3}


@pytest.mark.parametrize("args, kwargs, message", [
    ((1, 2, 3), {}, "forward() takes 2 positional argument(s) but 3 were given"),
    ((1,), {"x": 2}, "forward() got multiple values for argument 'x'"),
    ((1,), {"w": 2}, "forward() got an unexpected keyword argument 'w'"),
    ((), {}, "forward() missing a required argument: 'x'"),
])
def test_the_binder_refuses_calls_as_python_does(args, kwargs, message: str) -> None:
    with pytest.raises(TypeError) as caught:
        Binder(_forward).bind(args, kwargs)
    assert str(caught.value) == message


def test_a_forward_with_star_kwargs_binds_them_by_their_own_names() -> None:
    def forward(x, *args, **kwargs):
        return x

    binder = Binder(forward)
    assert not binder.simple
    assert binder.bind((1, 2), {"a": 3}) == {"x": 1, "args": (2,), "kwargs": {"a": 3}}
    assert binder.by_name((1,), {"a": 3, "b": 4}) == {"x": 1, "args": (), "a": 3, "b": 4}
