"""capture/eager_attention.py: an exported graph's attention with a boolean mask routed through
fxckpt's attention call, with what the mask is at the example's shapes when shapes alone decide
it; other attention calls left as they are. The same for Dynamo's graphs, the default training
path: Hugging Face models then run the kernels eager runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxckpt
from fxckpt.capture.eager_attention import Rewritten, eager_attention
from fxckpt.runtime.attention import attention, sized_mask
from fxckpt.runtime.checkpoint import checkpoint
from support import assert_steps_equal, run_step

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
    assert call.kwargs == {"is_causal": False}
    given = call.args[3]  # the mask's ops moved into a graph of their own, run at new sizes
    assert given.target is sized_mask and given.args[1:] == ()  # no sizes: a constant mask
    assert given.kwargs == {"at": (), "kind": "causal", "lengths": (4, 4)}
    assert not [n for n in gm.graph.nodes if n.target is aten.tril.default]
    assert not [n for n in gm.graph.nodes if n.target is SDPA]
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(gm(Q, K, V), F.scaled_dot_product_attention(Q, K, V, mask))


def test_a_mask_read_from_an_input_is_routed_without_an_expectation() -> None:
    gm = _graph("input")
    assert eager_attention(gm) == Rewritten(calls=1)
    assert "expect" not in _attention_calls(gm)[0].kwargs
    assert _attention_calls(gm)[0].args[3].op == "placeholder"


def test_float_masks_and_causal_calls_are_left_as_they_are() -> None:
    for gm in (_graph("float"), _graph("tril", causal=True)):
        code = gm.code
        assert eager_attention(gm) == Rewritten()
        assert gm.code == code and not _attention_calls(gm)


def test_a_graph_without_attention_is_unchanged() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert eager_attention(gm) == Rewritten(0, 0, 0, 0)


# Dynamo's graphs (the default training path): the same rewrite on torch-level calls.

def _dynamo_graphs(fn, *args: torch.Tensor, **kwargs) -> list[torch.fx.GraphModule]:
    """The graphs Dynamo captures of ``fn(*args, **kwargs)``, as fxckpt's backend receives them."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=kwargs.pop("dynamic", None))(*args, **kwargs)
    torch._dynamo.reset()
    return graphs


def _causal_from_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = q.shape[-2]
    rows = torch.arange(s, device=q.device)
    mask = (rows[None, :] <= rows[:, None]).expand(q.shape[0], 1, s, s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_dynamo_graph_s_mask_from_symbolic_sizes_is_routed_and_known_causal() -> None:
    (gm,) = _dynamo_graphs(_causal_from_sizes, Q, K, V, dynamic=True)
    assert any(n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in gm.graph.nodes)  # the sequence length is an input of the graph
    assert eager_attention(gm) == Rewritten(calls=1, repeats=0, expected=1, layers=0)
    given = _attention_calls(gm)[0].args[3]
    assert given.target is sized_mask and given.kwargs["kind"] == "causal"
    (size,) = given.args[1:]  # the symbolic sequence length, the mask's only input
    assert size.op == "placeholder" and given.kwargs["at"] == (4,)
    args = [_example(n) for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*args)[0], _causal_from_sizes(Q, K, V))


def _example(node: torch.fx.Node) -> object:
    """What the call gave the placeholder: a size's value, or the tensor it was traced from."""
    value = node.meta["example_value"]
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return {"l_q_": Q, "l_k_": K, "l_v_": V}[node.name]


def _random_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    mask = torch.rand(q.shape[-2], q.shape[-2]) > 0.5
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_dynamo_graph_s_mask_drawn_at_random_is_routed_but_not_built_at_capture() -> None:
    (gm,) = _dynamo_graphs(_random_mask, Q, K, V)
    state = torch.get_rng_state()
    assert eager_attention(gm) == Rewritten(calls=1)  # no expectation: it is never built
    assert torch.equal(torch.get_rng_state(), state)


class _Kernel:
    """Records what :func:`fxckpt.runtime.attention.attention` hands the aten op."""

    def __init__(self, monkeypatch) -> None:
        import fxckpt.runtime.attention as runtime

        self.calls: list[tuple[bool, bool, bool, int]] = []
        real = runtime._sdpa

        def sdpa(q, k, v, mask=None, dropout=0.0, causal=False, **kwargs):  # type: ignore
            self.calls.append((mask is not None, bool(causal),
                               bool(kwargs.get("enable_gqa")), k.shape[1]))
            return real(q, k, v, mask, dropout, causal, **kwargs)

        monkeypatch.setattr(runtime, "_sdpa", sdpa)


def _llama(kv_heads: int, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=kv_heads, use_cache=False, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


@pytest.mark.parametrize("strategy", [{}, {"every": 1}, {"budget": 0.5}],
                         ids=["unplanned", "every", "budget"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_hugging_face_on_the_default_path_runs_eager_kernels_bit_for_bit(
        monkeypatch, kv_heads: int, strategy: dict) -> None:
    """Eager Hugging Face runs ``is_causal=True``, with ``enable_gqa=True`` on the unrepeated
    key/value heads; Dynamo traced a boolean mask and repeated heads into the graph, whose masked
    kernel read the mask for every block (1.4x eager's step at sequence 2048 on this CPU)."""
    model = _llama(kv_heads)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    tm = fxckpt.transform(model, **strategy)
    kernel = _Kernel(monkeypatch)
    for step in range(2):
        assert_steps_equal(run_step(tm, (ids,), {}, seed=step),
                           run_step(reference, (ids,), {}, seed=step))
    code = "".join(m.code for m in fxckpt.inspect(tm).graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule))
    assert code.count("fxckpt_attention(") == 2 and code.count("kind = 'causal'") == 1
    # the repeats: a constant, or an input where Dynamo made the head count symbolic (another
    # model of the class compiled before)
    assert code.count("kv_repeats = ") == (2 if kv_heads < 4 else 0)
    assert kernel.calls and set(kernel.calls) == {(False, True, kv_heads < 4, kv_heads)}


def test_a_padding_mask_on_the_default_path_is_looked_at_each_call(monkeypatch) -> None:
    model = _llama(2)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    tm = fxckpt.transform(model, every=1)
    kernel = _Kernel(monkeypatch)
    for mask, seen in ((padded, (True, False, False, 4)),
                       (torch.ones(2, 12, dtype=torch.long), (False, True, True, 2))):
        kernel.calls.clear()
        assert_steps_equal(run_step(tm, (ids,), {"attention_mask": mask}),
                           run_step(reference, (ids,), {"attention_mask": mask}))
        assert kernel.calls and set(kernel.calls) == {seen}
    code = "".join(m.code for m in fxckpt.inspect(tm).graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule))
    assert "kv_repeats = " in code and "sized_mask" not in code  # the mask reads the inputs


def test_a_sliding_window_longer_than_the_sequence_keeps_its_mask_on_the_default_path(
        monkeypatch) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=4, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    tm = fxckpt.transform(model, every=1)
    kernel = _Kernel(monkeypatch)
    assert_steps_equal(run_step(tm, (ids,), {}), run_step(reference, (ids,), {}))
    assert kernel.calls and all(masked for masked, *_ in kernel.calls)  # a window, not causal


def _mistral(window: int) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=window, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).train()


@pytest.mark.parametrize("capture", ["export", "dynamo"])
def test_a_mask_from_sizes_is_looked_at_again_where_the_sizes_change_it(
        monkeypatch, capture: str) -> None:
    """Captured at 6 positions, a sliding window of 8 is causal: no mask is built there. At 12
    positions the window cuts: the mask is built and handed to the kernel, as eager does."""
    model = _mistral(window=8)
    reference = copy.deepcopy(model)
    short, long = torch.randint(0, 64, (2, 6)), torch.randint(0, 64, (2, 12))
    options = {"example_inputs": (short,)} if capture == "export" else {}
    tm = fxckpt.transform(model, every=1, **options)
    kernel = _Kernel(monkeypatch)
    for ids, masked in ((short, False), (long, True), (short, False)):
        kernel.calls.clear()
        assert_steps_equal(run_step(tm, (ids,), {}), run_step(reference, (ids,), {}))
        assert kernel.calls and {m for m, *_ in kernel.calls} == {masked}, ids.shape
    assert fxckpt.inspect(tm).plan.capture == capture


def test_no_segment_holds_a_mask_built_from_sizes() -> None:
    """The mask every layer shares was an input of every checkpointed segment, held from the
    forward to that segment's backward; built from sizes, it is now not built at all."""
    tm = fxckpt.transform(_llama(2, layers=3), every=1,
                          example_inputs=(torch.randint(0, 64, (2, 12)),))
    gm = fxckpt.inspect(tm).graph_module
    calls = [n for n in gm.graph.nodes if n.target is checkpoint]
    assert len(calls) >= 3  # one a layer at least
    for call in calls:
        inputs = [a.meta.get("val") for a in call.all_input_nodes]
        assert not any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in inputs)
    assert not [n for n in gm.graph.nodes if n.target in (aten.index.Tensor, aten.le.Tensor)]


def test_the_verdict_is_made_where_the_mask_was_built_outside_the_layers() -> None:
    """Made before the first layer as the mask was (not inside it, which would split the layer
    into two blocks for the per-block plans the search starts from), with the mask's module."""
    from fxckpt.capture.exporter import export_graph

    model, ids = _llama(2, layers=2), torch.randint(0, 64, (2, 12))
    gm = export_graph(model, (ids,), {}, ()).gm  # simplified: eager attention ran
    order = list(gm.graph.nodes)
    (given,) = [n for n in order if n.target is sized_mask]

    def in_layers(node: torch.fx.Node) -> bool:
        stack = node.meta.get("nn_module_stack", {}).values()
        return any("layers" in path for path, _ in stack)

    assert order.index(given) < min(i for i, n in enumerate(order) if in_layers(n))
    assert given.meta["nn_module_stack"] and not in_layers(given)
