"""What a loaded export's graphs may allocate, measured on fake tensors before any real call.

Every node of a loaded graph comes from the allowlist, but its arguments are the file's: one
added ``aten.ones([2**29])`` in an 18 KB export grew a process by 2 GiB at the first call. So
each saved graph runs one training step on fake tensors at load (nothing is allocated: fake
tensors carry shapes only) at the example shapes its root placeholders were saved with, and at the
first call of any other input shapes; the step's peak must stay within

    limit = max(max_activation_bytes or ACTIVATION_FACTOR x stated peak x input growth, FLOOR)

where the stated peak is the one the export's plan gives (a verified figure when ``save`` wrote
it; shown by ``fxckpt.inspect(loaded).plan`` before any call) and the input growth is how many
times more input bytes the call has than the saved example (activations grow with the batch).
An export over its limit is refused with an :class:`ExportError` naming it. The stated peak is
the export's own word: ``fxckpt.load(path, max_activation_bytes=N)`` bounds a stranger's export
absolutely.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._python_dispatch
import torch.utils._pytree as pytree

from fxckpt.errors import ExportError

__all__ = ["ACTIVATION_FACTOR", "FLOOR", "EXAMPLE", "example_of", "example_from", "input_bytes",
           "check_step", "check_saved", "saved_examples"]

EXAMPLE = "fxckpt_example"
"""``node.meta`` key of a loaded placeholder's saved example."""

ACTIVATION_FACTOR = 4
"""How many times its stated peak a graph's measured step may reach (the stand-in loss and a
fake step's temporaries hold more than the plan counts; no real graph measured here needed 2)."""
FLOOR = 64 << 20
"""The smallest limit, so that small graphs' loss and temporaries never refuse a load."""


def example_of(node: torch.fx.Node) -> Optional[dict[str, Any]]:
    """What a root placeholder was called with when the graph was planned, as data to save:
    ``{"shape": [...], "dtype": "float32", "grad": bool}`` for a tensor, else ``None``."""
    from fxckpt.cost.annotate import has_info, info

    if not has_info(node):
        return None
    found = info(node)
    if not (found.is_tensor and len(found.shapes) == 1 and len(found.dtypes) == 1):
        return None
    value = node.meta.get("val")
    grad = bool(getattr(value, "requires_grad", False))
    return {"shape": list(found.shapes[0]), "dtype": found.dtypes[0], "grad": grad}


def example_from(data: Any, where: str) -> dict[str, Any]:
    """A saved example checked: a shape of non-negative ints, a known dtype."""
    from fxckpt.export.targets import DTYPES

    shape = data.get("shape") if isinstance(data, dict) else None
    if not (isinstance(shape, list) and len(shape) <= 16
            and all(type(s) is int and 0 <= s < 2**48 for s in shape)
            and data.get("dtype") in DTYPES and isinstance(data.get("grad", False), bool)):
        raise ExportError(f"{where}: a placeholder's example must be a shape of ints and a dtype "
                          f"(got {str(data)[:80]})")
    return {"shape": shape, "dtype": data["dtype"], "grad": data.get("grad", False)}


def input_bytes(values: Any) -> int:
    """Bytes of the tensors among ``values`` (or the examples standing for them)."""
    total = 0
    for v in pytree.tree_leaves(values, is_leaf=_is_example):  # an example is counted whole
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif _is_example(v):
            total += math.prod(v["shape"]) * _dtype(v["dtype"]).itemsize
    return total


def _is_example(v: Any) -> bool:
    """A saved example standing for a tensor: ``{"shape": [...], "dtype": ...}``."""
    return isinstance(v, dict) and "shape" in v and "dtype" in v


def _dtype(name: str) -> torch.dtype:
    from fxckpt.export.targets import DTYPES

    return DTYPES[name]


def check_step(root: torch.nn.Module, run: Any, args: tuple, *, stated: Optional[int],
               growth: float, limit: Optional[int], where: str) -> int:
    """Run one training step of ``run(args)`` on fake tensors and refuse it past the limit;
    returns the measured peak. ``args`` may hold saved examples (built as fake tensors)."""
    if limit is None:
        limit = max(FLOOR, int(ACTIVATION_FACTOR * (stated or 0) * max(growth, 1.0)))
    device = _device(root)

    def step(fake_args: tuple, fake_kwargs: dict) -> Any:
        values = [_built(a, device) for a in fake_args]
        return run(tuple(values))

    try:
        peak = fake_step(root, lambda a: step(a, {}), tuple(args))
    except Exception as e:  # noqa: BLE001 - any failure of the graph's own ops
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ExportError(f"{where}: its graph does not run on fake tensors at the shapes it was "
                          "saved for, so what it allocates cannot be bounded "
                          f"({type(e).__name__}: {first})") from None
    if peak > limit:
        raise ExportError(
            f"{where}: one training step of its graph allocates {peak} bytes on fake tensors, "
            f"over the limit of {limit} bytes ({ACTIVATION_FACTOR}x the {stated} bytes its plan "
            "states, or max_activation_bytes=): refused before any real allocation")
    return peak


def _device(root: torch.nn.Module) -> torch.device:
    for t in (*root.parameters(), *root.buffers()):
        return t.device
    return torch.device("cpu")


def _built(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and "shape" in value:  # a saved example: a fake tensor of it
        t = torch.empty(value["shape"], dtype=_dtype(value["dtype"]), device=device)
        return t.requires_grad_(value["grad"] and t.is_floating_point())
    return value


def saved_examples(root: torch.fx.GraphModule) -> tuple:
    """The root graph's placeholders as saved: an example per tensor, the default otherwise."""
    return tuple(n.meta.get(EXAMPLE, n.args[0] if n.args else None)
                 for n in root.graph.nodes if n.op == "placeholder")


def check_saved(root: torch.fx.GraphModule, *, stated: Optional[int], limit: Optional[int],
                where: str) -> int:
    """:func:`check_step` of the root graph at its saved examples (placeholders fed flat)."""
    def run(values: tuple) -> Any:
        return torch.fx.Interpreter(root).run(*values, enable_io_processing=False)

    return check_step(root, run, saved_examples(root), stated=stated, growth=1.0, limit=limit,
                      where=where)


def fake_step(root: torch.nn.Module, run: Any, args: tuple) -> int:
    """Peak bytes of one training step ``stand_in_loss(run(args)).backward()`` on fake tensors,
    data-dependent sizes (``x[mask]``) included: each is counted at its largest (a mask selects
    at most all of its input), so the step is bounded, never underestimated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxckpt.measure.tracker import LiveTensorTracker
    from fxckpt.measure.verify import _existing_grads, _swapped_state, stand_in_loss

    env = ShapeEnv()
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=env, static_shapes=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = mode.from_tensor(t)
        return memo[id(t)]

    settle = _Settle(env)
    with _swapped_state(root, fake), mode:
        fake_args = pytree.tree_map_only(torch.Tensor, fake, args)
        _existing_grads(memo.values())
        with settle, LiveTensorTracker(fake=True, size=settle.size) as tracker:
            loss = stand_in_loss(run(fake_args))
            if loss is not None:
                loss.backward()
            del loss
    return tracker.peak_bytes


class _Settle(torch.utils._python_dispatch.TorchDispatchMode):
    """Gives each new data-dependent size its largest value (the element count of the op's
    largest input), so later shape checks can run and bytes can be counted."""

    def __init__(self, env: Any) -> None:
        super().__init__()
        self.env = env

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        out = func(*args, **(kwargs or {}))
        sized = [v for v in pytree.tree_leaves(out) if isinstance(v, (torch.Tensor, torch.SymInt))]
        known = self.env.real_tensor_prop_unbacked_vals
        fresh = [s for s in free_unbacked_symbols(sized) if s not in known]
        if fresh:
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            bound = max((self.size(t.numel()) for t in inputs), default=1)
            for symbol in fresh:
                self.env.set_real_tensor_prop_unbacked_vals(symbol, bound)
        return out

    def size(self, value: Any) -> int:
        """A size or byte count as an int (data-dependent ones at the value they were given)."""
        if isinstance(value, torch.SymInt):
            expr = value.node.expr.xreplace(self.env.real_tensor_prop_unbacked_vals)
            return int(self.env.size_hint(expr, allow_none=False))
        return int(value)
