"""Annotate: what every node of a captured graph produces, costs and touches.

The graph is run once on fake tensors (``FakeTensorMode``: shapes and dtypes only, no real
arithmetic and no change to RNG state or buffers). For each node, ``node.meta[META_KEY]`` gets a
:class:`NodeInfo`: output shapes and bytes, which earlier nodes its outputs alias (views) or it
writes in place, whether it draws random numbers, its FLOPs and the module path it came from.
The strategies and the memory simulator read only this record.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxckpt.errors import PlanError
from fxckpt.measure.meta_run import fake_twin, on_meta
from fxckpt.cost.flops import counter as flop_counter
from fxckpt.cost.fused_attention import no_dropout
from fxckpt.cost.prices import TABLE, call_terms, traffic
from fxckpt.capture.graphs import compute_nodes, is_guard, planned_nodes  # re-exported
from fxckpt.cost.node_info import META_KEY, NodeInfo, has_info, info, module_path_of
from fxckpt.cost.scratch import backward_scratch, call_scratch
from fxckpt.runtime.state import values_kept

__all__ = ["META_KEY", "NodeInfo", "annotate", "faking", "info", "has_info", "module_path_of",
           "compute_nodes", "is_guard", "planned_nodes"]  # the record is cost/node_info.py's

log = logging.getLogger(__name__)

def annotate(gm: torch.fx.GraphModule, placeholder_values: list,
             state: frozenset[str] = frozenset()) -> torch.fx.GraphModule:
    """Run ``gm`` on fake copies of ``placeholder_values`` and annotate every node in place.
    ``state``: placeholders that are parameters or buffers (a Dynamo graph's), not inputs.

    A graph whose tensors are all on ``meta`` already runs on them as they are, which fake
    tensors would only wrap (:mod:`fxckpt.measure.meta_run`); on fake tensors if that fails."""
    if on_meta(gm, tuple(placeholder_values), {}):
        try:
            with _kept_state(gm):
                _Annotator(gm, None, state).run(*placeholder_values)
            log.debug("annotated %d nodes on meta tensors", len(gm.graph.nodes))
            return gm
        except PlanError as e:
            log.debug("fxckpt: annotate on meta tensors failed (%s); faking them", e)
    with faking(gm) as fake_mode:
        fake = functools.partial(fake_twin, fake_mode)
        fake_args = [pytree.tree_map_only(torch.Tensor, fake, v) for v in placeholder_values]
        _Annotator(gm, fake_mode, state).run(*fake_args)
    log.debug("annotated %d nodes", len(gm.graph.nodes))
    return gm


@contextlib.contextmanager
def faking(gm: torch.fx.GraphModule) -> Iterator[FakeTensorMode]:
    """A fake tensor mode to run ``gm`` in; RNG states and ``gm``'s buffers stay as they were.

    A shape environment (with static input shapes) lets data-dependent ops such as a boolean
    mask's ``x[mask]`` run: their sizes become unbacked symbols, sized by ``_Annotator._settle``.
    """
    fake_mode = FakeTensorMode(
        allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True
    )
    with _kept_state(gm), fake_mode:
        yield fake_mode


@contextlib.contextmanager
def _kept_state(gm: torch.fx.GraphModule) -> Iterator[None]:
    """``gm``'s buffers as they were, whatever runs inside (fake tensors draw nothing from torch's
    generators, so they need no fork: fxckpt.runtime.state)."""
    with values_kept(gm.buffers()):
        try:
            yield
        finally:
            # Under a user's autocast region, autocast caches casts of parameters: drop the fake
            # ones.
            torch.clear_autocast_cache()


_SAC_IGNORED = getattr(
    torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}
)
"""Bookkeeping ops left out of ``NodeInfo.calls`` (torch 2.13's list for selective checkpoint;
else ``detach``)."""

# Ops whose schema does not mark the arguments they write (running statistics), by position.
_UNMARKED_WRITES = {
    "native_batch_norm": (3, 4),
    "cudnn_batch_norm": (3, 4),
    "miopen_batch_norm": (3, 4),
}


class _OpRecorder(TorchDispatchMode):
    """Records the aten ops one node runs and the tensors they write in place."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.calls: list[str] = []
        self.random = False
        self.work = 0.0
        self.terms: dict[str, float] = {}
        self.scratch = 0
        self.written: list[torch.Tensor] = []
        self.moved = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "prim":  # fake tensors answer `.device` through the dispatcher
            self.ops.append(str(func.overloadpacket.__name__))
        counted = func not in _SAC_IGNORED
        if counted:
            self.calls.append(str(func))
        random = torch.Tag.nondeterministic_seeded in func.tags and not no_dropout(func, args,
                                                                                  kwargs)
        self.random = self.random or random
        hidden = _UNMARKED_WRITES.get(func.overloadpacket.__name__, ())
        for i, arg in enumerate(func._schema.arguments):
            if i in hidden or (arg.alias_info is not None and arg.alias_info.is_write):
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                self.written += [
                    t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
                ]
        out = func(*args, **kwargs)
        if counted:
            terms = call_terms(func, args, kwargs, out, random)
            self.work += TABLE.work(terms)
            for key, amount in terms:
                self.terms[key] = self.terms.get(key, 0.0) + amount
            if not getattr(func, "is_view", False):
                self.moved += traffic(args, kwargs, out)
        self.scratch = max(self.scratch, call_scratch(func, args, kwargs),
                           backward_scratch(func, args, kwargs))
        return out


class _Annotator(torch.fx.Interpreter):
    """``fake_mode=None``: the values are meta tensors, run as they are (:func:`annotate`)."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: Optional[FakeTensorMode],
                 state_inputs: frozenset[str] = frozenset()) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode
        self.state_inputs = state_inputs
        fake = fake_mode.from_tensor if fake_mode is not None else _same
        self.owner: dict[StorageWeakRef, torch.fx.Node] = {}
        # One fake per parameter and buffer, kept alive here: the converter memoises a fake only
        # while it lives, and a get_attr node must hand out the same fake a module's op sees.
        # A module's op is recorded before fake conversion, so it shows the real buffer: both
        # count.
        buffers, params = dict(gm.named_buffers()), dict(gm.named_parameters())
        self.fakes = {name: fake(t) for name, t in {**params, **buffers}.items()}
        # State a node writes in place is put back around its recompute: buffers (running
        # statistics) and parameters (an EMA teacher updated under no_grad).
        state = {**params, **buffers}
        self.buffer_names = {id(b): name for name, b in state.items()}
        self.buffer_names.update({id(self.fakes[name]): name for name in state})
        # A leaf module's op sees the real tensors at the autograd layer (saved-tensor hooks get
        # the real Parameter), a get_attr node the fake: both are state, not activations.
        self.param_storages = {
            StorageWeakRef(self.fakes[name].untyped_storage()) for name in params
        }
        self.param_storages |= {
            StorageWeakRef(t.untyped_storage()) for t in {**params, **buffers}.values()
        }
        self.param_storages |= {
            StorageWeakRef(self.fakes[name].untyped_storage()) for name in buffers
        }

    def _owners(self, tensors: list) -> tuple[list[str], int]:
        """Nodes owning these saved tensors' storages, and bytes of those no node owns."""
        names: list[str] = []
        internal: dict[StorageWeakRef, int] = {}
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = StorageWeakRef(t.untyped_storage())
            if key in self.param_storages:
                continue
            owner = self.owner.get(key)
            if owner is None:
                internal[key] = self._int(t.untyped_storage().nbytes())
            elif owner.op != "get_attr" and owner.name not in names:
                names.append(owner.name)
        return names, sum(internal.values())

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        value = super().get_attr(target, args, kwargs)
        # The memoised fake of a parameter is the one its module's ops see, so views of it
        # alias it.
        if self.fake_mode is None or not isinstance(value, torch.Tensor):
            return value
        return self.fake_mode.from_tensor(value)

    def run_node(self, n: torch.fx.Node) -> Any:
        recorder = _OpRecorder()
        flops = flop_counter()
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        try:
            with flops, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = super().run_node(n)
        except Exception as e:
            raise PlanError(
                f"annotate: running {n.format_node()} on fake tensors failed: {e}"
            ) from e
        if n.op != "output":
            self._settle(n, out)
            n.meta[META_KEY] = self._describe(n, out, recorder, flops.get_total_flops(), saved)
        return out

    def _settle(self, n: torch.fx.Node, out: Any) -> None:
        """Size new data-dependent dimensions (``x[mask]``) at their upper bound: the element count
        of the node's largest input (a mask selects at most all of it)."""
        env = self.fake_mode.shape_env if self.fake_mode is not None else None
        if env is None:
            return
        sized = [v for v in pytree.tree_leaves(out) if isinstance(v, (torch.Tensor, torch.SymInt))]
        fresh = [
            s for s in free_unbacked_symbols(sized) if s not in env.real_tensor_prop_unbacked_vals
        ]
        if not fresh:
            return
        inputs = [
            t for t in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(t, torch.fx.Node)
        ]
        values = [
            v
            for a in inputs
            for v in pytree.tree_leaves(self.env.get(a))
            if isinstance(v, torch.Tensor)
        ]
        bound = max((self._int(v.numel()) for v in values), default=1)
        for symbol in fresh:
            env.set_real_tensor_prop_unbacked_vals(symbol, bound)

    def _int(self, value: Any) -> int:
        """A size, byte count or FLOP count as an int (data-dependent ones at their estimate)."""
        if isinstance(value, torch.SymInt):
            env = self.fake_mode.shape_env if self.fake_mode is not None else None
            assert env is not None
            return int(env.optimization_hint(value.node.expr, fallback=1))
        return int(value)

    def _describe(
        self, n: torch.fx.Node, out: Any, rec: _OpRecorder, flops: int, saved: list
    ) -> NodeInfo:
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        aliases, new_bytes = [], 0
        for t in tensors:
            key = StorageWeakRef(t.untyped_storage())
            owner = self.owner.get(key)
            if owner is None:
                self.owner[key] = n
                new_bytes += self._int(t.untyped_storage().nbytes())
            elif owner is not n and owner.name not in aliases:
                aliases.append(owner.name)
        mutates = []
        for t in rec.written:
            owner = self.owner.get(StorageWeakRef(t.untyped_storage()))
            if owner is not None and owner is not n and owner.name not in mutates:
                mutates.append(owner.name)
        saves, internal = self._owners(saved)
        writes_buffers = sorted(
            {self.buffer_names[id(t)] for t in rec.written if id(t) in self.buffer_names}
        )
        is_state = (n.op == "get_attr" or n.name in self.state_inputs) and isinstance(
            out, torch.Tensor)
        return NodeInfo(
            module_path=module_path_of(n),
            shapes=tuple(tuple(self._int(s) for s in t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors),
            device=str(tensors[0].device) if tensors else None,
            nbytes=sum(self._int(t.numel()) * t.element_size() for t in tensors),
            new_bytes=0 if is_state else new_bytes,
            aliases=tuple(aliases),
            mutates=tuple(mutates),
            writes_buffers=tuple(writes_buffers),
            saves=tuple(saves),
            saves_internal_bytes=internal,
            saved_count=len(saved),
            random=rec.random,
            flops=self._int(flops),
            work=rec.work,
            priced=tuple(rec.terms.items()),
            is_tensor=bool(tensors),
            is_state=is_state,
            ops=tuple(rec.ops),
            calls=tuple(rec.calls),
            scratch=self._int(rec.scratch),
            moved=self._int(rec.moved),
        )


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
