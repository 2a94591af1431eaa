"""How much of a training forward runs outside the graphs fxckpt planned, measured once.

Dynamo runs as Python what it cannot capture: the code at a graph break, a frame it gives up
on, a function marked ``torch._dynamo.disable``. Those tensors run eagerly and are not planned:
their activations are kept whatever the budget. :class:`Outside` is a dispatch mode that counts
the forward's FLOPs (PyTorch's own formulas, :mod:`torch.utils.flop_counter`) inside and outside
the planned graphs. It declares ``ignore_compile_internals``, so Dynamo still compiles under it
and hands it only what runs: the planned graphs' operators (which run eagerly) and the Python's.
It runs each operator as called (the same kernels, the same bits).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["Outside"]


class Outside(TorchDispatchMode):
    """FLOPs of one forward, split into those of planned graphs and the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.planned = 0
        self.unplanned = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @contextlib.contextmanager
    def in_graph(self) -> Iterator[None]:
        """Around a planned graph's run: its operators are planned."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = flop_registry.get(getattr(func, "_overloadpacket", None))
        if rule is not None:
            flops = int(rule(*args, **kwargs, out_val=out))
            if self.depth:
                self.planned += flops
            else:
                self.unplanned += flops
        return out

    @property
    def share(self) -> Optional[float]:
        """The unplanned share of the forward's FLOPs (``None`` when it counted none)."""
        total = self.planned + self.unplanned
        return None if total == 0 else self.unplanned / total


def graph_runs(mode: Optional[Outside]) -> contextlib.AbstractContextManager[None]:
    """What a graph's run is wrapped in: counted as planned while a measure is on."""
    return contextlib.nullcontext() if mode is None else mode.in_graph()
