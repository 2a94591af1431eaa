"""annotate records shapes, bytes, FLOPs, randomness, views, in-place writes and module paths."""

from __future__ import annotations

import torch
import torch.nn as nn

from fxckpt.cost.annotate import META_KEY, annotate
from fxckpt.capture.captured import capture
from models import ResNet, gpt2


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        v = y.view(4, 2, 4)
        v.add_(1)
        return self.drop(v).sum()


def _annotated(model: nn.Module, *args: torch.Tensor) -> dict:
    captured = capture(model, args, {})
    annotate(captured.gm, captured.graph_args(args, {}))
    return {n.name: n.meta[META_KEY] for n in captured.gm.graph.nodes if META_KEY in n.meta}


def test_linear_view_inplace_dropout() -> None:
    info = _annotated(Small(), torch.randn(4, 16))
    fc = info["fc"]
    assert fc.shapes == ((4, 8),) and fc.dtypes == ("float32",) and fc.nbytes == 4 * 8 * 4
    assert fc.flops == 2 * 4 * 16 * 8 and fc.module_path == "fc" and not fc.random
    view = info["view"]
    assert view.aliases == ("fc",) and view.new_bytes == 0 and view.flops == 0
    add_ = info["add_"]
    assert add_.mutates == ("fc",) and add_.aliases == ("fc",)
    assert info["drop"].random and info["drop"].module_path == "drop"
    assert info["x"].nbytes == 4 * 16 * 4


def test_batchnorm_writes_its_running_statistics() -> None:
    info = _annotated(ResNet(), torch.randn(2, 3, 8, 8))
    assert info["stem_1"].writes_buffers == (
        "stem.1.num_batches_tracked", "stem.1.running_mean", "stem.1.running_var")
    assert info["stem_0"].flops > 0 and info["stem_0"].writes_buffers == ()


def test_export_graph_keeps_module_paths() -> None:
    info = _annotated(gpt2(layers=2), torch.randint(0, 64, (2, 8)))
    paths = {i.module_path for i in info.values()}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= paths
    assert any(i.random for i in info.values())
    assert sum(i.flops for i in info.values()) > 0


def test_annotate_leaves_rng_and_buffers_alone() -> None:
    model = ResNet()
    before = [b.clone() for b in model.buffers()]
    x = torch.randn(2, 3, 8, 8)
    state = torch.get_rng_state()
    _annotated(model, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_records_what_autograd_saves() -> None:
    info = _annotated(Small(), torch.randn(4, 16, requires_grad=True))
    assert info["fc"].saves == ("x",)  # addmm keeps its input (and the weight, a parameter)
    assert info["view"].saves == ()
    assert (
        info["drop"].saves == () and info["drop"].saves_internal_bytes == 32 * 4
    )  # its mask (float on CPU)
    assert info["fc"].saves_internal_bytes == 0


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_attention_is_counted_as_two_batched_matmuls() -> None:
    """torch's counter has no formula for the CPU attention kernel and counted 0: the solver then
    priced attention by its output's bytes (about 1/18 of its time here) and recomputed it."""
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    info = _annotated(Attention(), q, k, v)
    (attention,) = [i for i in info.values() if i.flops]
    assert attention.flops == 2 * (2 * b * h * s * s * d)


def test_the_counter_counts_cpu_attention_backward_and_grouped_heads() -> None:
    from fxckpt.cost.flops import counter

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    kv = torch.randn(2, 2, 16, 8, requires_grad=True)
    with counter() as forward:
        out = nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    with counter() as backward:
        out.sum().backward()
    one = 2 * 2 * 4 * 16 * 16 * 8  # one (b*h, s, d) x (b*h, d, s) batched matmul
    assert forward.get_total_flops() == 2 * one and backward.get_total_flops() == 5 * one


def test_a_node_export_left_without_a_module_stack_belongs_to_the_root() -> None:
    """torch.export names a node it found no module stack for after its metadata hook; plans
    showed that name as a module path (``_empty_nn_module_stack_from_metadata_hook``)."""
    from fxckpt.cost.annotate import module_path_of

    graph = torch.fx.Graph()
    node = graph.call_function(torch.relu, (graph.placeholder("x"),))
    node.meta["nn_module_stack"] = {
        "_empty_nn_module_stack_from_metadata_hook": (
            "_empty_nn_module_stack_from_metadata_hook", torch.nn.Module)}
    assert module_path_of(node) == ""
    node.meta["nn_module_stack"] = {"L__self___layers_0": ("L['self'].layers[0]", torch.nn.Module)}
    assert module_path_of(node) == "layers.0"
