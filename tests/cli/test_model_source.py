"""cli/model_source.py: the command line's TARGET, ``module:callable`` imported from the current
directory and called, or a config.json path; each mistake a SourceError saying what to do."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from fxckpt.cli.model_source import SourceError, build_model, hf_config_path, load_target

MODELS = '''
import torch

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())

class Net(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 2)

instance = torch.nn.Linear(3, 3)
number = 3

def broken():
    raise RuntimeError("no weights")

def not_a_model():
    return "mlp"

class holder:
    inner = staticmethod(mlp)
'''


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A current directory holding ``fx_models.py``, forgotten afterwards."""
    (tmp_path / "fx_models.py").write_text(MODELS)
    (tmp_path / "fx_broken.py").write_text("import no_such_dependency_here\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_target puts the directory there
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("fx_")]:
        del sys.modules[name]


def test_a_callable_or_a_class_is_called_and_a_module_used_as_it_is(here: Path) -> None:
    assert isinstance(load_target("fx_models:mlp"), torch.nn.Sequential)
    assert type(load_target("fx_models:Net")).__name__ == "Net"
    assert load_target("fx_models:instance").in_features == 3
    assert isinstance(load_target("fx_models:holder.inner"), torch.nn.Sequential)


@pytest.mark.parametrize("target, message", [
    ("fx_models", r"TARGET must look like package.module:callable \(got 'fx_models'\)"),
    (":mlp", "TARGET must look like"),
    ("fx_nowhere:mlp", r"no module named 'fx_nowhere' \(run from the directory"),
    ("fx_broken:mlp", "importing 'fx_broken' failed: No module named 'no_such_dependency_here'"),
    ("fx_models:missing", "module 'fx_models' has no attribute 'missing'"),
    ("fx_models:number", "fx_models:number is a int, not a callable returning a model"),
    ("fx_models:broken", r"calling fx_models:broken\(\) failed: RuntimeError: no weights"),
    ("fx_models:not_a_model", r"fx_models:not_a_model\(\) returned a str, not a "
                              r"torch.nn.Module"),
])
def test_a_target_that_gives_no_model_says_why(here: Path, target: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        load_target(target)


def test_meta_builds_shapes_without_memory_and_dtype_converts(here: Path) -> None:
    model = build_model("fx_models:mlp", meta=True, dtype=torch.float16)
    weight = model[0].weight
    assert weight.device.type == "meta" and weight.dtype == torch.float16
    assert weight.shape == (8, 4)


def test_config_paths_are_a_json_file_or_a_directory_holding_config_json(tmp_path: Path) -> None:
    assert hf_config_path("pkg.module:make") is None
    (tmp_path / "config.json").write_text("{}")
    assert hf_config_path(str(tmp_path)) == str(tmp_path / "config.json")
    assert hf_config_path(str(tmp_path / "config.json")) == str(tmp_path / "config.json")
    with pytest.raises(SourceError, match="^no such config file: .*other.json$"):
        hf_config_path(str(tmp_path / "other.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="empty is a directory without a config.json$"):
        hf_config_path(str(tmp_path / "empty"))
