"""The module :func:`fxckpt.load` returns: a transformed module without its original model.

It holds the model's parameters and buffers under the model's own names (``state_dict()`` has
the original keys, so a training job can keep using its checkpoints) and one rewritten graph
per saved *variant* (input signature and mode). A call picks the variant by the same signature
key :class:`~fxckpt.module.TransformedModule` uses; symbolic graphs, which do not depend on
shapes, also serve calls that differ only in tensor shapes. Without the model's code nothing can
be planned again, so any other call is refused with the list of signatures the export holds.

    LoadedModule
      ├── (state) transformer.h.0.ln_1.weight, ...   registered: parameters(), state_dict()
      └── variants[i].root  -- GraphModule tree, sharing those very tensors (not registered)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from fxckpt.errors import ExportError
from fxckpt.export.codec import decode
from fxckpt.export.rebuild import Slot, check_name, put
from fxckpt.plan import Plan
from fxckpt.signature import variant_key

__all__ = ["LoadedModule", "Variant"]

_UNSAVED = object()
_P = inspect.Parameter
_KINDS = {
    k.name: k
    for k in (
        _P.POSITIONAL_ONLY,
        _P.POSITIONAL_OR_KEYWORD,
        _P.VAR_POSITIONAL,
        _P.KEYWORD_ONLY,
        _P.VAR_KEYWORD,
    )
}


class Variant:
    """One saved graph: the mode and signature it serves, how to call it, and its plan."""

    def __init__(self, entry: dict[str, Any], root: torch.fx.GraphModule, slots: list[Slot],
                 view: Any, pipeline: Optional[torch.nn.Module] = None) -> None:
        self.key: str = entry["key"]
        self.loose_key: str = entry["loose_key"]
        self.training: bool = entry["training"]
        self.capture: str = entry["capture"]
        self.pipeline = pipeline
        """The rebuilt GPipe runner of a staged plan (``None`` without stages)."""
        self.plan = Plan.from_dict(entry["plan"])
        self.root = root
        self.slots = slots
        self.view = view
        self.signature = None if entry["parameters"] is None else _signature(entry["parameters"])
        self.limit: Optional[int] = None
        """``fxckpt.load(max_activation_bytes=)``: the bound of :mod:`fxckpt.export.bound`."""
        self.checked = {self.key}
        """Call keys whose step was measured on fake tensors (the saved one at load)."""

    @property
    def stated_peak(self) -> Optional[int]:
        """The peak activation memory the export's plan states for this graph."""
        return self.plan.peak_bytes or self.plan.eager_peak_bytes

    def describe(self) -> str:
        return f"{'train' if self.training else 'eval'} {self.plan.signature}"

    def check(self, args: tuple, kwargs: dict) -> None:
        """The first call of new input shapes: its step measured on fake tensors first
        (:mod:`fxckpt.export.bound`). Pipelined graphs are measured at load only."""
        key = repr(variant_key(self.training, args, kwargs))
        if key in self.checked or self.pipeline is not None:
            return
        import torch.utils._pytree as pytree

        from fxckpt.export.bound import check_step, input_bytes, saved_examples

        leaves, spec = pytree.tree_flatten((args, kwargs))

        def run(values: tuple) -> Any:
            a, k = pytree.tree_unflatten(list(values), spec)
            return self(a, k)

        growth = input_bytes(leaves) / max(1, input_bytes(saved_examples(self.root)))
        check_step(self.root, run, tuple(leaves), stated=self.stated_peak, growth=growth,
                   limit=self.limit, where=f"a call of {_describe(args, kwargs)}")
        self.checked.add(key)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.signature is None:
            return (
                self.root(*args, **kwargs)
                if self.pipeline is None
                else self._pipelined(args, kwargs)
            )
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        missing = [k for k, v in bound.arguments.items() if v is _UNSAVED]
        if missing:
            raise ExportError(f"pass {missing}: their defaults could not be saved in the export")
        return (self.pipeline or self.root)(*bound.arguments.values())

    def _pipelined(self, args: tuple, kwargs: dict) -> Any:
        """An exported graph's calling convention around the pipeline (as PipelinedModule does)."""
        import torch.fx._pytree as fx_pytree
        import torch.utils._pytree as pytree

        in_spec: Any = self.root.__dict__["_in_spec"]
        out_spec: Any = self.root.__dict__["_out_spec"]
        runner: Any = self.pipeline
        bound = inspect.signature(self.root.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        names = runner.__dict__["_fxckpt_orig_args"] or list(bound.arguments)
        values = [bound.arguments[name.split(":")[0].strip()] for name in names]
        if in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(1).type is dict:
            count = in_spec.child(0).num_children
            tree: Any = (
                tuple(values[:count]),
                dict(zip(in_spec.child(1).context, values[count:])),
            )
        else:
            tree = values
        out = runner(*fx_pytree.tree_flatten_spec(tree, in_spec))
        return pytree.tree_unflatten(
            list(out) if isinstance(out, (tuple, list)) else [out], out_spec
        )


def _signature(parameters: list[dict[str, Any]]) -> inspect.Signature:
    params = []
    for p in parameters:
        default = (
            decode(p["default"])
            if "default" in p
            else _UNSAVED
            if p.get("default_unsaved")
            else inspect.Parameter.empty
        )
        params.append(inspect.Parameter(p["name"], _KINDS[p["kind"]], default=default))
    return inspect.Signature(params)


class LoadedModule(torch.nn.Module):
    """A transformed module rebuilt from an export (see :func:`fxckpt.load`)."""

    def __init__(
        self,
        state: list[dict[str, Any]],
        tensors: dict[str, torch.Tensor],
        variants: list[Variant],
        manifest: dict[str, Any],
        training: bool,
        training_kwargs: Optional[dict[str, bool]] = None,
    ) -> None:
        super().__init__()
        self.__dict__["_training_kwargs"] = dict(training_kwargs or {})
        self.__dict__["_variants"] = variants
        self.__dict__["_manifest"] = manifest
        self.__dict__["_last"] = variants[0]
        self.__dict__["_owners"] = {}
        for entry in state:
            self._register(entry, tensors[entry["key"]])
        in_state = {entry["key"] for entry in state}
        for key in dict.fromkeys(s[3] for v in variants for s in v.slots if s[3] not in in_state):
            kind = "parameter" if isinstance(tensors[key], torch.nn.Parameter) else "buffer"
            name = "_fxckpt_constants." + "".join(c if c.isalnum() else "_" for c in key)
            self._register(
                {"name": name, "key": key, "kind": kind, "persistent": False}, tensors[key]
            )
        self.training = training

    def _register(self, entry: dict[str, Any], value: torch.Tensor) -> None:
        *parents, name = check_name(entry["name"], "a tensor of the export").split(".")
        mod: torch.nn.Module = self
        for part in parents:
            if part not in mod._modules:
                mod._modules[part] = torch.nn.Module()
            mod = mod._modules[part]  # type: ignore[assignment]
        if entry["kind"] == "parameter":
            mod._parameters[name] = value  # type: ignore[assignment]
        else:
            mod._buffers[name] = value
            if not entry.get("persistent", True):
                mod._non_persistent_buffers_set.add(name)
        self.__dict__["_owners"].setdefault(
            entry["key"],
            (mod, "param" if entry["kind"] == "parameter" else "buffer", name, entry["key"]),
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:  # what the transformed module adds to a training call (use_cache), last
            added = self.__dict__["_training_kwargs"]
            kwargs = {**kwargs, **{k: v for k, v in added.items() if k not in kwargs}}
        variant = self._variant_for(args, kwargs)
        self.__dict__["_last"] = variant
        variant.check(args, kwargs)
        return variant(args, kwargs)

    def _variant_for(self, args: tuple, kwargs: dict) -> Variant:
        from fxckpt.export.describe import loose_key

        key = variant_key(self.training, args, kwargs)
        variants: list[Variant] = self.__dict__["_variants"]
        for v in variants:
            if v.key == repr(key):
                return v
        loose = repr(loose_key(key))
        for v in variants:
            if v.capture == "symbolic_trace" and v.loose_key == loose:
                return v
        held = "; ".join(v.describe() for v in variants)
        raise ExportError(
            f"this export holds graphs for {held}; the call is "
            f"{'train' if self.training else 'eval'} {_describe(args, kwargs)}. Without the "
            "model's code fxckpt cannot plan again: save the transformed module after calling it "
            "with these inputs (or pass example_inputs= to fxckpt.save)"
        )

    @property
    def variants(self) -> list[Variant]:
        """The saved graphs (one per input signature and mode), the latest-planned first."""
        return list(self.__dict__["_variants"])

    @property
    def variant(self) -> Variant:
        """The saved graph the latest call ran (before any call: the one saved last)."""
        return self.__dict__["_last"]

    @property
    def plan(self) -> Plan:
        """The plan of the latest call's graph (before any call: the one saved last)."""
        return self.__dict__["_last"].plan

    @property
    def code(self) -> str:
        """The rewritten forward's code (as ``TransformedModule.code``)."""
        return self.__dict__["_last"].root.code

    @property
    def graph_module(self) -> torch.nn.Module:
        """The rewritten graph's ``GraphModule`` (``.code``; ``.segment_0.code``: a segment's)."""
        return self.__dict__["_last"].root

    @property
    def pipeline(self) -> Optional[torch.nn.Module]:
        """The GPipe runner of the latest call's graph (``None`` without stages)."""
        return self.__dict__["_last"].pipeline

    @property
    def manifest(self) -> dict[str, Any]:
        """The export's manifest: versions, file hashes, content hash."""
        return dict(self.__dict__["_manifest"])

    def _apply(self, fn: Callable, recurse: bool = True) -> "LoadedModule":
        super()._apply(fn, recurse)
        owners: dict[str, Slot] = self.__dict__["_owners"]
        current = {key: _read(owner) for key, owner in owners.items()}
        for v in self.__dict__["_variants"]:
            for slot in v.slots:
                if slot[3] in current:
                    put(slot, current[slot[3]])
        return self

    def extra_repr(self) -> str:
        return f"variants={[v.describe() for v in self.__dict__['_variants']]}"


def _read(slot: Slot) -> torch.Tensor:
    mod, kind, name, _ = slot
    return (
        mod._parameters[name]  # type: ignore[return-value]
        if kind == "param"
        else mod._buffers[name]
    )


def _describe(args: tuple, kwargs: dict) -> str:
    from fxckpt.signature import describe_signature

    return describe_signature(args, kwargs)

