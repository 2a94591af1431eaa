"""capture/eager_attention.py: an exported graph's attention with a boolean mask routed through
fxckpt's attention call, with what the mask is at the example's shapes when shapes alone decide
it; other attention calls left as they are."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from fxckpt.capture.eager_attention import Rewritten, eager_attention
from fxckpt.runtime.attention import attention

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
Q, K, V = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)


def _graph(mask_from: str, causal: bool = False) -> torch.fx.GraphModule:
    """``sdpa(q, k, v, mask)`` with the mask built from shapes (``tril``), given as an input
    (``input``), or a float mask from shapes (``float``)."""
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    for node, value in zip((q, k, v), (Q, K, V)):
        node.meta["val"] = value
    if mask_from == "input":
        mask = graph.placeholder("mask")
        mask.meta["val"] = torch.ones(4, 4, dtype=torch.bool)
    else:
        dtype = torch.float32 if mask_from == "float" else torch.bool
        ones = graph.call_function(aten.ones.default, ([4, 4],), {"dtype": dtype})
        mask = graph.call_function(aten.tril.default, (ones,))
        mask.meta["val"] = torch.ones(4, 4, dtype=dtype).tril()
    out = graph.call_function(SDPA, (q, k, v), {"attn_mask": mask, "is_causal": causal})
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is attention]


def test_a_mask_built_from_shapes_is_routed_and_known_causal() -> None:
    gm = _graph("tril")
    assert eager_attention(gm) == Rewritten(calls=1, repeats=0, expected=1, layers=0)
    (call,) = _attention_calls(gm)
    assert call.kwargs == {"is_causal": False, "expect": "causal"}
    assert not [n for n in gm.graph.nodes if n.target is SDPA]
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(gm(Q, K, V), F.scaled_dot_product_attention(Q, K, V, mask))


def test_a_mask_read_from_an_input_is_routed_without_an_expectation() -> None:
    gm = _graph("input")
    assert eager_attention(gm) == Rewritten(calls=1)
    assert "expect" not in _attention_calls(gm)[0].kwargs


def test_float_masks_and_causal_calls_are_left_as_they_are() -> None:
    for gm in (_graph("float"), _graph("tril", causal=True)):
        code = gm.code
        assert eager_attention(gm) == Rewritten()
        assert gm.code == code and not _attention_calls(gm)


def test_a_graph_without_attention_is_unchanged() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert eager_attention(gm) == Rewritten(0, 0, 0, 0)
