"""integrations/framework.py: the Framework protocol, checked at run time by the members an
object has, and a module that imports nothing of fxckpt."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from fxckpt.integrations import framework as module
from fxckpt.integrations.framework import Framework
from fxckpt.integrations.hf import HuggingFace

ATTRIBUTES = ("name", "transparent_hooks", "gqa_head_limit")
METHODS = ("release_own_checkpointing", "class_overrides", "checkpointing_switches",
           "own_checkpointing_on", "takes_use_cache", "without_cache", "is_output",
           "names_output_type", "output_class", "attention_causality",
           "from_attention_interface", "repeated_kv", "model_from_config_file")


def _answering(*leave_out: str) -> Any:
    """An object with every member of the protocol but ``leave_out``."""
    members: dict[str, Any] = {name: None for name in ATTRIBUTES if name not in leave_out}
    members.update({name: lambda self, *a, **k: None for name in METHODS
                    if name not in leave_out})
    return type("Answering", (), members)()


def test_the_protocol_is_these_members() -> None:
    own = {name for name in vars(Framework) if not name.startswith("_")}
    assert own == set(METHODS)
    assert set(Framework.__annotations__) == set(ATTRIBUTES)


def test_an_object_with_every_member_is_a_framework_and_one_without_any_is_not() -> None:
    assert isinstance(_answering(), Framework)
    for missing in ("name", "repeated_kv", "model_from_config_file"):
        assert not isinstance(_answering(missing), Framework), missing
    assert not isinstance(object(), Framework)


def test_hugging_face_answers_it() -> None:
    assert isinstance(HuggingFace(), Framework)


def test_the_module_imports_nothing_of_fxckpt() -> None:
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.startswith("fxckpt")]
