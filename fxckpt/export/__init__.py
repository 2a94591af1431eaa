"""Save a transformed module and load it where the original model's code is not available.

    fxckpt.save(tm, "gpt2_ckpt/", key=secret)    # graphs as data, weights, plan, signed manifest
    tm2 = fxckpt.load("gpt2_ckpt/", key=secret)  # same outputs and gradients, no model class

Why it is built this way:

* **Data, not code.** Loading runs no code supplied by the export. The rewritten graph and each
  ``segment_N`` are written as node lists whose call targets are names from a fixed table of
  torch operators, Tensor methods and fxckpt runtime functions (:mod:`fxckpt.export.targets`);
  loading rebuilds each graph with ``torch.fx.Graph.create_node`` and lets torch.fx generate
  its code, after checking every name that torch.fx prints into that code. ``torch.nn`` leaf
  modules are rebuilt from an explicit class table and data-only attributes. Nothing is
  imported by a name the export gives (except ``transformers`` output classes, by a strict
  pattern), nothing is unpickled (weights are safetensors, read by a checked parser; old
  ``weights.pt`` exports only on request, with ``weights_only``).
  So loading needs torch and fxckpt (and ``transformers`` for Hugging Face outputs), never the
  user's classes, and a graph that calls the user's own functions is refused by ``save``.
* **Verified before use.** Every file's SHA-256 is in the manifest, with a content hash over
  all of them; a flipped byte anywhere is an :class:`ExportError` naming the file. Those hashes
  catch corruption only: whoever can edit the files can recompute them. ``save(..., key=)``
  adds an HMAC-SHA256 of the manifest under a secret key, and ``load(..., key=)`` then refuses
  any change; a keyed export cannot be loaded without its key.
* **Atomic.** A save writes into a temporary directory renamed into place; see
  :mod:`fxckpt.export.files`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from fxckpt.export.allowlist import extended
from fxckpt.export.bound import check_saved
from fxckpt.export.files import (MAX_JSON_BYTES, as_key, verify, versions, write_atomically,
                                 write_export)
from fxckpt.export.loaded import LoadedModule, Variant
from fxckpt.errors import (ConfigError, ExportError,  # ExportError re-exported
                           dynamo_needs_whole_graph, not_transformed)
from fxckpt import integrations

__all__ = ["save", "load", "ExportError", "LoadedModule"]

PathLike = Union[str, os.PathLike]
Key = Union[str, bytes, None]


def save(tm: torch.nn.Module, path: PathLike, *, example_inputs: Optional[Sequence[Any]] = None,
         example_kwargs: Optional[Mapping[str, Any]] = None, key: Key = None) -> Path:
    """Write the transformed module ``tm`` to the directory ``path``; returns the path.

    The export holds every graph ``tm`` has planned (one per input signature and mode). With
    ``example_inputs`` / ``example_kwargs``, ``tm`` first plans for them in both ``train()`` and
    ``eval()`` mode, so the loaded module can do both. With ``key`` (a secret ``str`` or
    ``bytes``) the manifest is signed with HMAC-SHA256, and loading it needs the same key. An
    existing export at ``path`` is replaced; any other existing, non-empty directory is refused.
    """
    secret = as_key(key)
    from fxckpt.export.describe import describe, unplanned
    from fxckpt.module import dispatcher_of, is_transformed

    if not is_transformed(tm):
        raise ExportError(not_transformed("fxckpt.save", tm))
    dispatcher = dispatcher_of(tm)
    if dispatcher.config.capture == "dynamo":
        raise ExportError(dynamo_needs_whole_graph("an export holds one whole graph per call"))
    if dispatcher.config.offload:
        raise ExportError.offloads("this module")
    if example_inputs is not None or example_kwargs is not None:
        _plan_both_modes(tm, tuple(example_inputs or ()), dict(example_kwargs or {}))
    if dispatcher.dynamo is not None and not dispatcher.whole_graphs():
        raise ExportError(
            "this module trains through Dynamo (capture='auto'), whose graphs are not one whole "
            "graph of the model: pass example_inputs= to fxckpt.save to capture and plan one to "
            "save")
    if dispatcher.last is None:
        raise unplanned()
    described = describe(tm)
    # what a training call adds to the caller's keywords (use_cache=False for a Hugging Face
    # model): the loaded module adds the same, so the same calls find their graphs
    added = (integrations.without_cache(dispatcher.model, {}) if dispatcher.takes_use_cache
             else None)
    described.structure["training_kwargs"] = added or {}
    described.structure["devices"] = {k: str(t.device) for k, t in described.tensors.items()}
    described.structure["tensor_bytes"] = sum(
        t.numel() * t.element_size() for t in described.tensors.values())
    texts = dict(described.texts)
    texts["structure.json"] = json.dumps(described.structure, indent=1)
    texts["plan.json"] = json.dumps(described.plan, indent=2)
    return write_atomically(
        path, lambda tmp: write_export(tmp, texts, described.tensors, versions(), secret))


def _plan_both_modes(tm: Any, args: tuple, kwargs: dict) -> None:
    from fxckpt.module import dispatcher_of

    mode = tm.training
    try:
        for training in (not mode, mode):  # the original mode last: it stays the latest plan
            tm.train(training)
            dispatcher_of(tm).compiled_for(tm, args, kwargs)
    finally:
        tm.train(mode)


def load(path: PathLike, *, map_location: Optional[Union[str, torch.device]] = None,
         key: Key = None, max_bytes: Optional[int] = None, mmap: bool = False,
         legacy_weights: bool = False, allow: Iterable[str] = (),
         max_json_bytes: int = MAX_JSON_BYTES,
         max_activation_bytes: Optional[int] = None) -> LoadedModule:
    """Rebuild the module saved at ``path`` (see :class:`~fxckpt.export.loaded.LoadedModule`).

    Every file is checked against the manifest first; a missing or corrupted file raises
    :class:`ExportError`. An export saved with a ``key`` needs the same ``key`` here, and then
    any change to any file is refused too; passing ``key`` for an export without a MAC is
    refused. Nothing in the export is run as code. Tensors go to the devices they were saved
    from, or to ``map_location``.

    The weights are read once into memory the module owns, from the bytes whose hash was
    checked (:mod:`fxckpt.export.weights`); ``mmap=True`` maps the file instead (its pages are
    the parameters until written, and a change to the file shows in them: never with ``key=``).
    ``max_bytes`` bounds the weights file (default: twice the tensor bytes the export declares).
    ``legacy_weights=True`` reads a ``weights.pt`` (torch.save) export, refused otherwise.

    What the graphs may call is a closed allowlist (:mod:`fxckpt.export.allowlist`); ``allow``
    names more (``"torch.ops.aten.fft_rfft.default"``, ``"torch.Tensor.cumprod"``) for an export
    whose source you trust, never an operator a rule refuses. JSON files over ``max_json_bytes``
    are refused before they are read. Each graph runs one training step on fake tensors at load
    (and at a call's first new input shapes); a step past ``max_activation_bytes``, by default
    4x the peak the export's plan states (:mod:`fxckpt.export.bound`), is refused before any
    real allocation.
    """
    from fxckpt.checks import check_int

    secret = as_key(key)
    device = _map_location(map_location)
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, unit="of bytes")
    check_int("max_json_bytes", max_json_bytes, unit="of bytes")
    if max_activation_bytes is not None:
        check_int("max_activation_bytes", max_activation_bytes, unit="of bytes")
    allowed = _allowed(allow)
    if mmap and secret is not None:
        raise ConfigError("mmap=True cannot be combined with key=: a mapped file can change "
                          "after its MAC was checked, and the weights in use must be the bytes "
                          "the key verified. Load keyed exports without mmap")
    store = verify(path, secret, max_json_bytes)
    try:
        with extended(allowed):
            loaded = _rebuild(store, device, max_bytes, mmap, legacy_weights)
        for i, variant in enumerate(loaded.variants):
            variant.limit = max_activation_bytes
            check_saved(variant.root, stated=variant.stated_peak, limit=max_activation_bytes,
                        where=f"export {store.root}: the graph of programs/v{i}/root.json "
                              f"({variant.describe()})")
    except ImportError as e:
        raise ExportError(
            f"loading export {store.root} needs {e.name or 'a package'} ({e}); install it"
        ) from e
    except ExportError:
        raise
    except (
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        RecursionError,
        RuntimeError,
    ) as e:
        raise ExportError(
            f"export {store.root}: structure.json is not a valid structure ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from e
    return loaded


def _allowed(allow: Iterable[str]) -> frozenset[str]:
    if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
        raise ConfigError(f"allow must be a list of names such as "
                          f"'torch.ops.aten.fft_rfft.default' (got {allow!r:.80})")
    return frozenset(allow)


def _rebuild(store: Any, device: Optional[torch.device], max_bytes: Optional[int], mmap: bool,
             legacy_weights: bool) -> LoadedModule:
    """The module tree of every variant, on the verified files."""
    from fxckpt.export.rebuild import build_tree
    from fxckpt.export.views import view_from_json

    structure = json.loads(store.read_text("structure.json"))
    declared = structure.get("tensor_bytes")
    limit = max_bytes if max_bytes is not None else (
        2 * declared + (1 << 20) if isinstance(declared, int) else None)
    raw = store.tensors(max_bytes=limit, use_mmap=mmap, legacy=legacy_weights)
    tensors = _materialise(structure, raw, device, store.root)
    variants = []
    for entry in structure["variants"]:
        root, slots = build_tree(entry["modules"], store, tensors, entry["training"])
        if not isinstance(root, torch.fx.GraphModule):
            raise ExportError(f"export {store.root}: a variant's root module is not a graph")
        runner = None
        if entry.get("pipeline"):
            runner, stage_slots = _pipeline(entry["pipeline"], store, tensors, entry["training"])
            slots += stage_slots
        variants.append(
            Variant(entry, root, slots, view_from_json(store.read_text(entry["view"])), runner)
        )
    added = structure.get("training_kwargs", {})
    if not (isinstance(added, dict) and all(isinstance(k, str) and isinstance(v, bool)
                                            for k, v in added.items())):
        raise ExportError(f"export {store.root}: structure.json's training_kwargs must map "
                          f"names to true or false (got {str(added)[:80]})")
    return LoadedModule(structure["state"], tensors, variants, store.manifest,
                        structure["training"], added)


def _pipeline(
    entry: dict[str, Any], store: Any, tensors: dict[str, torch.Tensor], training: bool
) -> tuple[Any, list]:
    """The GPipe runner of a staged variant, rebuilt around its stages' code modules."""
    from fxckpt.export.rebuild import build_tree
    from fxckpt.runtime.pipeline import Pipeline

    stages, slots = [], []
    for modules in entry["stages"]:
        stage, stage_slots = build_tree(modules, store, tensors, training)
        stages.append(stage)
        slots += stage_slots
    runner = Pipeline(
        stages,
        entry["devices"],
        entry["chunks"],
        entry["checkpoint"],
        input_names=entry["input_names"],
    )
    for m in (runner, *runner.stages):  # the graph's mode, as build_pipeline sets it
        m.training = training
    runner.__dict__["_fxckpt_orig_args"] = entry.get("orig_args")
    return runner, slots


def _map_location(value: Any) -> Optional[torch.device]:
    """``map_location`` as a device (checked before the export is read)."""
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"map_location must be a device such as 'cpu' or 'cuda:0' (got "
                          f"{value!r:.60}): {e}") from None


def _materialise(structure: dict[str, Any], raw: dict[str, torch.Tensor],
                 map_location: Optional[torch.device], root: Path) -> dict[str, torch.Tensor]:
    """Raw tensors as Parameters (with their ``requires_grad``) or buffers, on their devices."""
    grads = {e["key"]: e["requires_grad"] for e in structure["state"] if e["kind"] == "parameter"}
    for v in structure["variants"]:
        for m in v["modules"]:
            for key in m.get("params", {}).values():
                if key is not None:
                    grads.setdefault(key, True)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        device = map_location or torch.device(structure.get("devices", {}).get(key, "cpu"))
        _check_available(device, root)
        t = t.to(device)
        out[key] = torch.nn.Parameter(t, requires_grad=grads[key]) if key in grads else t
    return out


def _check_available(device: torch.device, root: Path) -> None:
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ExportError(f"export {root} holds tensors saved on {device}, which this machine "
                          "does not have; pass map_location='cpu' (or another device) to "
                          "fxckpt.load")
