"""Splitting inputs into micro-batches and joining outputs back."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from fxckpt.runtime.microbatch import batch_size, gather, scatter


def test_uneven_and_small_batches() -> None:
    x = torch.arange(8.0).reshape(8, 1)
    assert [mb[0][0].shape[0] for mb in scatter((x,), {}, 3)] == [3, 3, 2]
    assert [mb[0][0].shape[0] for mb in scatter((x,), {}, 7)] == [2, 1, 1, 1, 1, 1, 1]
    assert len(scatter((x[:2],), {}, 4)) == 2  # fewer pieces than chunks when the batch is small
    assert len(scatter((x,), {}, 1)) == 1 and scatter((x,), {}, 1)[0][0][0] is x
    assert torch.equal(torch.cat([mb[0][0] for mb in scatter((x,), {}, 3)]), x)


def test_non_tensors_and_scalars_go_to_every_micro_batch() -> None:
    x, mask, scale = torch.randn(6, 4), torch.ones(6, 4), torch.tensor(2.0)
    pieces = scatter((x, 0.5), {"mask": mask, "scale": scale, "flag": True, "nothing": None}, 2)
    assert len(pieces) == 2
    for (args, kwargs), rows in zip(pieces, (slice(0, 3), slice(3, 6))):
        assert torch.equal(args[0], x[rows]) and args[1] == 0.5
        assert torch.equal(kwargs["mask"], mask[rows])
        assert kwargs["scale"] is scale and kwargs["flag"] is True and kwargs["nothing"] is None


def test_nested_inputs_are_split() -> None:
    x = torch.randn(4, 3)
    (a0, k0), (a1, k1) = scatter(([x, {"y": x * 2}],), {}, 2)
    assert torch.equal(a0[0][1]["y"], (x * 2)[:2]) and torch.equal(a1[0][0], x[2:])


def test_batch_sizes_that_disagree_are_named() -> None:
    msg = r"same batch size along dim 0.*got x: 8, args\[1\]: 6, mask: 8"
    with pytest.raises(ValueError, match=msg):
        scatter((torch.randn(8, 2), torch.randn(6, 2)), {"mask": torch.randn(8)}, 2, names=["x"])
    assert batch_size((1, "a"), {}) is None


def test_bad_chunks() -> None:
    for chunks in (0, -1, 2.0, True):
        with pytest.raises(
            ValueError, match=rf"chunks must be a positive integer \(got {chunks!r}\)"
        ):
            scatter((torch.randn(4),), {}, chunks)  # type: ignore[arg-type]


def test_gradients_flow_through_scatter_and_gather() -> None:
    x = torch.randn(6, 3, requires_grad=True)
    outs = [a[0] * 2 for a, _ in scatter((x,), {}, 4)]
    gather(outs).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    n: int


def test_gather_keeps_structure() -> None:
    t = [torch.full((2, 1), float(i)) for i in range(3)]
    out = gather([{"x": ti, "meta": ("tag", 7, None), "p": Pair(ti, [ti])} for ti in t])
    assert list(out) == ["x", "meta", "p"] and out["x"].shape == (6, 1)
    assert out["meta"] == ("tag", 7, None)  # the same in every micro-batch: the batch's value
    assert (
        isinstance(out["p"], Pair)
        and isinstance(out["p"].b, list)
        and out["p"].b[0].shape == (6, 1)
    )
    res = gather([Result(ti, 3) for ti in t])
    assert isinstance(res, Result) and res.logits.shape == (6, 1) and res.n == 3
    od = gather([collections.OrderedDict(a=ti) for ti in t])
    assert type(od) is collections.OrderedDict


def test_gather_keeps_model_outputs() -> None:
    transformers = pytest.importorskip("transformers")
    outs = [
        transformers.modeling_outputs.CausalLMOutput(logits=torch.randn(2, 3, 5)) for _ in range(2)
    ]
    out = gather(outs)
    assert type(out) is type(outs[0]) and out.logits.shape == (4, 3, 5) and out.loss is None
    assert torch.equal(out[0], torch.cat([o.logits for o in outs]))


def test_gather_errors() -> None:
    with pytest.raises(ValueError, match=r"output\['loss'\] of micro-batch 0 is a 0-dim tensor"):
        gather([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}])
    with pytest.raises(
        ValueError, match=r"keys \['a'\] in micro-batch 0 but \['b'\] in micro-batch 1"
    ):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(
        ValueError, match="is a tuple in micro-batch 0 but a list in micro-batch 1"
    ):
        gather([(torch.ones(1),), [torch.ones(1)]])
    with pytest.raises(ValueError, match="at least one"):
        gather([])


def test_non_tensor_outputs_that_differ_between_micro_batches_are_named() -> None:
    t = torch.ones(2, 1)
    message = (r"output\['n'\] is 2 in micro-batch 0 but 1 in micro-batch 2; a non-tensor output "
               r"must be the same in every micro-batch")
    with pytest.raises(ValueError, match=message):
        gather([{"x": t, "n": 2}, {"x": t, "n": 2}, {"x": t[:1], "n": 1}])
    with pytest.raises(ValueError, match=r"output\.n is 0 in micro-batch 0 but 1 in micro-batch"):
        gather([Result(t, 0), Result(t, 1)])
    with pytest.raises(ValueError, match=r"output\[1\] is 'a' in micro-batch 0 but 'b'"):
        gather([(t, "a"), (t, "b")])
