"""Framework rules behind one protocol: the rest of fxckpt asks the
frameworks around a model only through :mod:`fxckpt.integrations`, which asks every registered
:class:`~fxckpt.integrations.framework.Framework` (Hugging Face's always). A fake second
framework, registered for a test, is consulted through the same entry points and the callers
behind them: the protocol is the seam."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.fx

from fxckpt import integrations
from fxckpt.cli.model_source import build_model
from fxckpt.errors import SourceError
from fxckpt.export.codec import _check_type
from fxckpt.runtime.microbatch import gather
from fxckpt.signature import has_hooks

PACKAGE = Path(__file__).resolve().parents[2] / "fxckpt"


def _imports_of_a_framework(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, name)`` for every import (lazy and ``TYPE_CHECKING`` ones too) of a module
    inside ``fxckpt.integrations`` (``fxckpt.integrations.hf``, ``from fxckpt.integrations
    import hf``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("fxckpt.integrations.")
                  and (PACKAGE / "integrations" / f"{n.split('.')[2]}.py").exists()]
    return found


def test_only_the_registry_imports_a_frameworks_rules() -> None:
    """No module outside ``fxckpt/integrations/`` imports ``fxckpt.integrations.hf`` (or the
    protocol's module): they ask ``fxckpt.integrations``."""
    inside = ast.parse((PACKAGE / "integrations" / "__init__.py").read_text(encoding="utf-8"))
    assert (any(n == "fxckpt.integrations.hf" for _, n in _imports_of_a_framework(inside))
            ), "the scan must see the registry's own import of the Hugging Face rules"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "integrations":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
                  for line, name in _imports_of_a_framework(tree)]
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: integrations.hf"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr == "hf"
                  and isinstance(node.value, ast.Name) and node.value.id == "integrations"]
    assert not found, "\n".join(found)


def test_registering_hugging_face_imports_nothing_of_transformers() -> None:
    import subprocess
    import sys

    code = ("import sys, fxckpt, fxckpt.integrations as i; "
            "assert [f.name for f in i.frameworks()] == ['huggingface']; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- Hugging Face's rules, registered, on a tiny GPT-2 -------------------------------------------


def test_hugging_face_is_registered_and_answers_the_protocol(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    (hf,) = integrations.frameworks()
    assert hf.name == "huggingface" and isinstance(hf, integrations.Framework)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32,
                                     vocab_size=64, bos_token_id=0, eos_token_id=0)
    assert config.use_cache  # on, as GPT2Config() has it
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    assert integrations.takes_use_cache(model)
    assert integrations.without_cache(model, {"labels": 1}) == {"labels": 1, "use_cache": False}
    assert integrations.without_cache(model, {"use_cache": True}) is None

    overrides = integrations.class_overrides(type(model))
    assert "gradient_checkpointing_enable" in overrides
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable()
    switches = integrations.checkpointing_switches(model)
    assert len(switches) >= 1 and integrations.own_checkpointing_on(switches)
    layers = integrations.release_own_checkpointing(model)
    assert layers[0] == "transformer" and "transformer.h.1" in layers
    assert not integrations.own_checkpointing_on(switches)
    assert integrations.release_own_checkpointing(model) == []

    out = model(torch.arange(8).reshape(1, 8))
    name = f"{type(out).__module__}.{type(out).__name__}"
    assert integrations.is_output(out) and not integrations.is_output({"a": 1})
    assert integrations.names_output_type(name)
    assert not integrations.names_output_type("collections.OrderedDict")
    from torch.utils import _pytree as pytree

    assert integrations.output_class(name, pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE) is True
    assert integrations.output_class("builtins.tuple", {}) is None
    assert integrations.attention_causality(model) is True
    assert integrations.attention_causality(torch.nn.Linear(2, 2)) is None
    assert "transformers.utils.output_capturing" in integrations.transparent_hooks()
    assert integrations.gqa_head_limit() == 256
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    assert not integrations.from_attention_interface(x)
    assert integrations.repeated_kv(x) is None

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                "n_positions": 32, "vocab_size": 64, "bos_token_id": 0,
                                "eos_token_id": 0,
                                "architectures": ["GPT2LMHeadModel"]}))
    built = integrations.model_from_config_file(str(path), None)
    assert type(built) is transformers.GPT2LMHeadModel and built.config.use_cache is False
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a Hugging Face model config"):
        integrations.model_from_config_file(str(path), None)


# -- a second framework, through the same entry points ------------------------------------------


class FakeOutput(dict):
    """A fake framework's output mapping: rebuilt as ``FakeOutput(**fields)``."""


class Fake:
    """A second framework answering every question of the protocol with values of its own."""

    name = "fake"
    transparent_hooks = ("fake.hooks",)
    gqa_head_limit: Optional[int] = 128

    def __init__(self) -> None:
        self.released: list[torch.nn.Module] = []

    def release_own_checkpointing(self, model: torch.nn.Module) -> list[str]:
        self.released.append(model)
        return ["fake.layer"]

    def class_overrides(self, model_cls: type) -> dict[str, Callable[..., Any]]:
        return {"fake_checkpointing_enable": lambda self: None}

    def checkpointing_switches(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [model]

    def own_checkpointing_on(self, switches: list[torch.nn.Module]) -> bool:
        return any(getattr(m, "fake_on", False) for m in switches)

    def takes_use_cache(self, model: torch.nn.Module) -> bool:
        return True

    def without_cache(self, model: torch.nn.Module, kwargs: dict,
                      announce: bool = False) -> Optional[dict]:
        return {**kwargs, "fake_cache": False}

    def is_output(self, x: Any) -> bool:
        return isinstance(x, FakeOutput)

    def names_output_type(self, type_name: str) -> bool:
        return type_name.startswith("fake.")

    def output_class(self, type_name: str, registered: dict[str, Any]) -> Optional[bool]:
        return type_name == "fake.Output" if type_name.startswith("fake.") else None

    def attention_causality(self, module: torch.nn.Module) -> Optional[bool]:
        return False

    def from_attention_interface(self, node: torch.fx.Node) -> bool:
        return node.name == "fake_attention"

    def repeated_kv(self, node: Any) -> Optional[tuple[torch.fx.Node, int]]:
        return (node, 3) if isinstance(node, torch.fx.Node) else None

    def model_from_config_file(self, path: str,
                               dtype: Optional[torch.dtype]) -> torch.nn.Module:
        return torch.nn.Linear(3, 5)


@pytest.fixture
def fake() -> Iterator[Fake]:
    framework = Fake()
    integrations.register(framework)
    integrations.register(framework)  # once, however often
    try:
        yield framework
    finally:
        integrations.unregister(framework)
    assert framework not in integrations.frameworks()


def test_a_second_framework_is_asked_through_the_same_entry_points(
        fake: Fake, tmp_path: Path) -> None:
    assert [f.name for f in integrations.frameworks()] == ["huggingface", "fake"]
    model = torch.nn.Linear(2, 2)  # not Hugging Face's: its rules all say "not mine"
    assert integrations.release_own_checkpointing(model) == ["fake.layer"]
    assert fake.released == [model]
    assert set(integrations.class_overrides(torch.nn.Linear)) == {"fake_checkpointing_enable"}
    assert integrations.checkpointing_switches(model) == [model]
    assert not integrations.own_checkpointing_on([model])
    model.fake_on = True
    assert integrations.own_checkpointing_on([model])
    assert integrations.takes_use_cache(model)
    assert integrations.without_cache(model, {"x": 1}) == {"x": 1, "fake_cache": False}
    assert integrations.transparent_hooks()[-1] == "fake.hooks"
    assert integrations.is_output(FakeOutput(a=1))
    assert integrations.names_output_type("fake.Output")
    assert integrations.output_class("fake.Output", {}) is True
    assert integrations.output_class("fake.Other", {}) is False
    assert integrations.attention_causality(model) is False
    assert integrations.gqa_head_limit() == 128
    graph = torch.fx.Graph()
    node = graph.placeholder("fake_attention")
    assert integrations.from_attention_interface(node)
    assert integrations.repeated_kv(node) == (node, 3)


def test_the_callers_consult_a_second_framework(fake: Fake, tmp_path: Path) -> None:
    """The rules reach the modules that use them: hooks, micro-batch outputs, export's pytree
    types and the command line's config files."""
    module = torch.nn.Linear(2, 2)
    hook = module.register_forward_hook(lambda *a: None)
    assert has_hooks(module)
    setattr(module._forward_hooks[hook.id], "__module__", "fake.hooks")
    assert not has_hooks(module)  # the fake's own hooks are the model's code

    joined = gather([FakeOutput(y=torch.ones(1, 2)), FakeOutput(y=torch.zeros(2, 2))])
    assert type(joined) is FakeOutput and joined["y"].shape == (3, 2)

    _check_type("fake.Output", "test")  # an export may name the fake's output types
    with pytest.raises(Exception, match="uses the pytree node type 'other.Output'"):
        _check_type("other.Output", "test")

    path = tmp_path / "config.json"
    path.write_text("{}")  # no model_type: Hugging Face's rules refuse it, the fake's build
    assert type(build_model(str(path))) is torch.nn.Linear


def test_after_unregistering_only_hugging_face_answers(tmp_path: Path) -> None:
    framework = Fake()
    integrations.register(framework)
    integrations.unregister(framework)
    assert integrations.gqa_head_limit() == 256
    assert integrations.without_cache(torch.nn.Linear(2, 2), {}) is None
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(SourceError, match="not a Hugging Face model config"):
        build_model(str(path))


def test_register_refuses_what_does_not_answer_the_protocol() -> None:
    with pytest.raises(TypeError, match="does not answer fxckpt's Framework protocol"):
        integrations.register(object())  # type: ignore[arg-type]
    assert [f.name for f in integrations.frameworks()] == ["huggingface"]
