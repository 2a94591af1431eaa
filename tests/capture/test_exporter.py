"""torch.export's input guards as fxckpt keeps them (torch 2.11 writes some it cannot run)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fxckpt.capture.exporter import _mend_guards, export_graph


def _guards(body: str) -> torch.fx.GraphModule:
    """A GraphModule holding a guard function generated like torch.export's (``def _(*args)``)."""
    namespace: dict = {"torch": torch}
    exec(f"def _(*args):\n  torch._assert({body}, 'Guard failed')\n  return\n", namespace)
    guards = torch.nn.Module()
    guards.forward = namespace["_"]  # type: ignore[method-assign]
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm._guards_fn = guards
    return gm


def test_a_guard_that_reads_an_undefined_name_is_replaced_and_a_sound_one_kept() -> None:
    broken = _guards("args[1] == nan")  # how torch 2.11 writes a NaN float argument's guard
    original = broken._guards_fn.forward
    _mend_guards(broken)
    assert broken._guards_fn.forward is not original
    assert broken._guards_fn(torch.ones(2), float("nan")) is None

    sound = _guards("args[0].size()[0] == 2")
    kept = sound._guards_fn.forward
    _mend_guards(sound)
    assert sound._guards_fn.forward is kept
    try:
        sound._guards_fn(torch.ones(3))
    except (AssertionError, RuntimeError) as e:
        assert "Guard failed" in str(e)
    else:
        raise AssertionError("a sound guard stopped checking")


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale


def test_an_export_for_a_nan_argument_runs_on_the_inputs_it_was_made_for() -> None:
    model, x = Scaled(), torch.randn(2, 4)
    exported = export_graph(model, (x,), {"scale": float("nan")}, ())
    out = exported.gm(x, scale=float("nan"))
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert torch.isnan(out).all()


def test_a_model_on_meta_is_exported_for_its_shapes_and_a_real_one_for_every_batch() -> None:
    """Meta models are planned, never trained: symbolic sizes would only slow their capture."""
    real = export_graph(Scaled(), (torch.randn(2, 4),), {}, ())
    assert real.shapes is not None and real.shapes.accepts(((7, 4),))
    with torch.device("meta"):
        model = Scaled()
    on_meta = export_graph(model, (torch.empty(2, 4, device="meta"),), {}, ())
    assert on_meta.shapes is not None
    assert on_meta.shapes.accepts(((2, 4),)) and not on_meta.shapes.accepts(((7, 4),))


def test_a_graph_input_passed_straight_to_an_opaque_module_reaches_it() -> None:
    """``nn.Sequential``'s argument is ``input``, a Python builtin that ``ep.module()`` renames;
    torch's swap looked the name up, found nothing and handed the hooked first block ``None``
    (the first training call of an FSDP-sharded Sequential failed in ``linear()``)."""

    import fxckpt

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16),
                                                          torch.nn.GELU()) for _ in range(4)])
        model[0].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
        return model

    x = torch.randn(64, 16)
    exported = export_graph(make(), (x,), {}, opaque=("0",))
    block = next(n for n in exported.gm.graph.nodes if n.op == "call_module" and n.target == "0")
    assert all(a is not None for a in pytree.tree_leaves(block.args)), block.format_node()
    for options in ({"every": 2}, {"depth": 1}, {"budget": 0.8}):
        model, reference = make(), make()
        tm = fxckpt.transform(model, capture="export", **options)
        tm(x).square().sum().backward()
        reference(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (options, name)
