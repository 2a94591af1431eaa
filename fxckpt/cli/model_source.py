"""Where the command line's model comes from: ``module:callable``, or a Hugging Face config.

``fxckpt plan`` builds the model it plans from its ``TARGET``:

* ``package.module:callable``: the callable (a function or a class) is called with no arguments
  and must return an ``nn.Module``; the current directory is importable, as with ``python -m``;
* a Hugging Face ``config.json`` (the file, or a directory holding one): the model class its
  ``architectures`` names (else ``AutoModel``) is built from the config with random weights,
  without downloading anything, in the config's dtype (``torch_dtype``) unless told otherwise.

With ``meta=True`` the model is built under ``torch.device("meta")``: parameters have shapes
and dtypes but no memory, so a 70 B configuration plans on a laptop.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any, Optional

import torch

from fxckpt.errors import SourceError  # re-exported
from fxckpt import integrations

__all__ = ["SourceError", "build_model", "load_target", "hf_config_path"]


def build_model(target: str, *, meta: bool = False,
                dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The model ``target`` names (see the module's docstring), on the meta device if ``meta``,
    with floating parameters in ``dtype`` when given."""
    where = torch.device("meta") if meta else contextlib.nullcontext()
    config = hf_config_path(target)
    with where:
        model = _from_hf_config(config, dtype) if config else load_target(target)
    if dtype is not None:
        model = model.to(dtype)
    return model


def hf_config_path(target: str) -> Optional[str]:
    """The ``config.json`` ``target`` names (a file, or a directory holding one), else None."""
    if os.path.isdir(target):
        path = os.path.join(target, "config.json")
        if not os.path.isfile(path):
            raise SourceError(f"{target} is a directory without a config.json")
        return path
    if target.endswith(".json"):
        if not os.path.isfile(target):
            raise SourceError(f"no such config file: {target}")
        return target
    return None


def _from_hf_config(path: str, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    try:
        return integrations.model_from_config_file(path, dtype)
    except ValueError as e:
        raise SourceError(str(e)) from e


def load_target(text: str) -> torch.nn.Module:
    """Import ``module:callable`` and call it (an ``nn.Module`` instance is used as it is)."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise SourceError(f"TARGET must look like package.module:callable (got {text!r})")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = _import(module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SourceError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise SourceError(
                f"{text} is a {type(obj).__name__}, not a callable returning a model")
        try:
            obj = obj()
        except Exception as e:
            raise SourceError(f"calling {text}() failed: {type(e).__name__}: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise SourceError(f"{text}() returned a {type(obj).__name__}, not a torch.nn.Module")
    return obj


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise SourceError(
                f"no module named {name!r} (run from the directory that contains it, or set "
                "PYTHONPATH)"
            ) from e
        raise SourceError(f"importing {name!r} failed: {e}") from e
    except Exception as e:
        raise SourceError(f"importing {name!r} failed: {type(e).__name__}: {e}") from e
