"""Promise 5: bad input gets a clear error with the value seen and the fix."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest
import torch

import fxckpt
import fxckpt.budget
import fxckpt.errors
from fxckpt.capture.captured import capture
from models import MLP, DataDependent
from support import loss_of


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"every": 2, "depth": 1}, "give at most one strategy, got every=2 and depth=1"),
        ({"every": 0}, "every must be a positive integer (got 0)"),
        ({"every": -1}, "every must be a positive integer (got -1)"),
        ({"every": 2.5}, "every must be a positive integer (got 2.5)"),
        ({"every": True}, "every must be a positive integer (got True)"),
        ({"depth": 0}, "depth must be a positive integer (got 0)"),
        (
            {"depth": 4},
            "depth=4 is deeper than the model: its deepest module 'layers.0.fc' has depth 3",
        ),
        (
            {"force": {"layers.9": "save"}},
            "force names module 'layers.9', which the model does not have",
        ),
        (
            {"force": {"layers.0": "sometimes"}},
            "force['layers.0'] must be one of ('recompute', 'save') (got 'sometimes')",
        ),
        ({"force": ["layers.0"]}, "force must be a dict of module path"),
    ],
)
def test_bad_options_raise_config_error(kwargs: dict, message: str) -> None:
    with pytest.raises(fxckpt.ConfigError) as e:
        fxckpt.transform(MLP(), **kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_force_suggests_close_paths() -> None:
    with pytest.raises(fxckpt.ConfigError, match=r"did you mean 'layers.1'"):
        fxckpt.transform(MLP(), force={"layer.1": "recompute"})


def test_non_module_is_rejected() -> None:
    with pytest.raises(
        fxckpt.ConfigError, match=r"model must be a torch.nn.Module \(got function\)"
    ):
        fxckpt.transform(lambda x: x * 2, every=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", [fxckpt.transform, fxckpt.pareto])
def test_a_non_module_is_a_type_error(call: object) -> None:
    with pytest.raises(TypeError) as e:
        call("not a module")  # type: ignore[operator]
    assert isinstance(e.value, fxckpt.ConfigError)
    assert str(e.value).startswith("model must be a torch.nn.Module (got str)")


def test_untraceable_model_without_inputs_names_the_fixes() -> None:
    with pytest.raises(fxckpt.CaptureError) as e:
        capture(DataDependent())
    text = str(e.value)
    assert "symbolic_trace failed with TraceError" in text
    assert "pass example inputs" in text and "torch.fx.wrap" in text and "concrete_args" in text


def test_untraceable_model_reports_both_capture_failures() -> None:
    tm = fxckpt.transform(DataDependent(), every=1, capture="graph")
    with pytest.raises(fxckpt.CaptureError) as e:
        tm(torch.randn(2, 4))
    text = str(e.value)
    assert "symbolic_trace failed with TraceError" in text
    assert "export failed with" in text and "torch.cond" in text


def test_a_torch_compiled_module_is_refused_with_the_module_inside_named() -> None:
    """Its calls would bypass fxckpt (nothing planned, no graph): refused by name."""
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    with pytest.raises(fxckpt.ConfigError, match=r"torch.compile'd Linear \(OptimizedModule\).*"
                       r"fxckpt.transform\(model._orig_mod"):
        fxckpt.transform(compiled, every=1)


def test_example_inputs_must_be_a_tuple() -> None:
    with pytest.raises(
        fxckpt.ConfigError, match=r"example_inputs must be a tuple .* \(got Tensor\)"
    ):
        fxckpt.transform(
            MLP(), every=1, example_inputs=torch.randn(2, 32)  # type: ignore[arg-type]
        )


def test_plan_before_first_call_says_how_to_get_one() -> None:
    tm = fxckpt.transform(MLP(), every=1)
    with pytest.raises(fxckpt.NotPlannedError, match="plans at its first training call"):
        fxckpt.inspect(tm).plan


def test_second_backward_without_retain_graph() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    tm = fxckpt.transform(MLP(), every=1)
    loss = loss_of(tm(x))
    loss.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


def test_second_backward_with_retain_graph_matches() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    tm = fxckpt.transform(MLP(p=0.0), every=1)
    loss = loss_of(tm(x))
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


class ShapeShifter(torch.nn.Module):
    """Recomputes differently: a counter changes the shape it makes the second time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_recompute_mismatch_names_the_segment() -> None:
    model = ShapeShifter()
    x = torch.randn(3, 4, requires_grad=True)
    tm = fxckpt.transform(model, every=1, example_inputs=(x,))
    segment = fxckpt.inspect(tm).graph_module.segment_0
    original = segment.forward
    calls = {"n": 0}

    def flaky(inp: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return original(inp if calls["n"] == 1 else inp.double().float()[:2])

    segment.forward = flaky
    out = tm(x)
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as e:
        out.sum().backward()
    text = str(e.value)
    assert "tensor at position 0" in text
    assert "saved metadata: {'segment': 'segment_0', 'shape': torch.Size([3, 4])" in text
    assert "recomputed metadata: {'segment': 'segment_0', 'shape': torch.Size([2, 4])" in text


class Checked(torch.nn.Module):
    """Refuses inputs of the wrong width itself, as models do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 4:
            raise ValueError(f"Checked expects 4 features, got {x.shape[-1]}")
        return self.fc(x)


@pytest.mark.parametrize("call", [
    lambda tm, x: tm(),
    lambda tm, x: tm(x, x),
    lambda tm, x: tm(y=x),
    lambda tm, x: tm([x]),
    lambda tm, x: tm(torch.randn(2, 5)),
], ids=["no_argument", "one_too_many", "unknown_keyword", "a_list", "the_models_own_check"])
@pytest.mark.parametrize("capture_with", ["auto", "symbolic_trace", "export"])
def test_a_call_the_model_refuses_raises_what_the_model_raises(call, capture_with: str) -> None:
    x = torch.randn(2, 4)
    with pytest.raises(Exception) as expected:
        call(Checked(), x)
    tm = fxckpt.transform(Checked(), every=1, capture=capture_with)
    with pytest.raises(type(expected.value)) as got:
        call(tm, x)
    assert str(got.value) == str(expected.value)
    assert not isinstance(got.value, fxckpt.FxckptError)


@pytest.mark.parametrize("options,message", [
    ({"budget": "1e400GiB"}, "budget='1e400GiB' is not valid: it is larger than any memory"),
    ({"every": 1, "offload": True, "offload_device": "nonsense"},
     "offload_device must be 'cpu' or a CUDA device like 'cuda:0'"),
    ({"every": 1, "offload_device": "cpu"}, "offload_device='cpu' was given without offload="),
    ({"force": []}, r"force must be a dict of module path -> 'recompute' \| 'save' \(got list\)"),
    ({"force": 0}, r"force must be a dict .* \(got int\)"),
    ({"force": set()}, r"force must be a dict .* \(got set\)"),
    ({"capture": "trace"},
     "capture must be one of 'auto', 'dynamo', 'graph', 'symbolic_trace', 'export'"),
])
def test_bad_options_are_config_errors_that_name_the_argument(options: dict,
                                                              message: str) -> None:
    with pytest.raises(fxckpt.ConfigError, match=message):
        fxckpt.transform(MLP(), **options)


def test_a_plan_saved_in_one_process_replays_in_another(tmp_path) -> None:
    """Anchors name targets as text that is the same in every process (no memory addresses)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import fxckpt
from models import Positions
torch.manual_seed(0)
x = torch.randn(2, 8, 16)
if sys.argv[1] == "save":
    tm = fxckpt.transform(Positions(), every=1, example_inputs=(x,))
    json.dump(fxckpt.inspect(tm).plan.to_dict(), open({plan!r}, "w"))
else:
    plan = json.load(open({plan!r}))
    tm = fxckpt.transform(Positions(), plan=plan, example_inputs=(x,))
    replayed = fxckpt.inspect(tm).plan.to_dict()
    print(json.dumps([s["nodes"] for s in replayed["segments"]]))
"""
    tests, plan = str(Path(__file__).resolve().parent), str(tmp_path / "plan.json")
    code = script.format(tests=tests, plan=plan)
    for step in ("save", "replay"):
        out = subprocess.run([sys.executable, "-c", code, step], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    saved = json.loads(Path(plan).read_text())
    assert "0x" not in json.dumps(saved)  # no `<built-in method arange ... at 0x7f...>`
    assert json.loads(out.stdout) == [s["nodes"] for s in saved["segments"]]


def _documented_errors() -> set[str]:
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return {name for path in texts
            for name in re.findall(r"\b([A-Z][A-Za-z]*Error)\b", path.read_text())}


# errors the docs name that are not fxckpt's: Python's, and PyTorch's recompute check
_NOT_OURS = {"CheckpointError": torch.utils.checkpoint.CheckpointError}


def test_every_error_class_the_docs_name_is_importable_from_fxckpt() -> None:
    """``except fxckpt.ExportError:`` must never fail with an AttributeError while handling the
    real error: every error class the guide and the docs name is on the top level."""
    names = _documented_errors()
    assert {"CaptureError", "ExportError", "BudgetInfeasibleError"} <= names  # the walk works
    for name in sorted(names):
        if hasattr(builtins, name):
            continue
        if name in _NOT_OURS:
            assert not hasattr(fxckpt, name)
            continue
        cls = getattr(fxckpt, name, None)
        assert isinstance(cls, type) and issubclass(cls, fxckpt.FxckptError), name
        assert name in fxckpt.__all__, name


def test_every_error_class_fxckpt_defines_is_on_the_top_level() -> None:
    import fxckpt.errors
    import fxckpt.export
    import fxckpt.measure
    import fxckpt.measure.verify

    for name in fxckpt.errors.__all__:
        assert getattr(fxckpt, name) is getattr(fxckpt.errors, name), name
    assert fxckpt.ExportError is fxckpt.export.ExportError  # the old home still works
    assert fxckpt.VerifyError is fxckpt.measure.verify.VerifyError
    assert fxckpt.MeasureError is fxckpt.measure.MeasureError
    assert issubclass(fxckpt.BudgetInfeasibleError, fxckpt.FxckptError)
    assert fxckpt.BudgetInfeasibleError is fxckpt.budget.BudgetInfeasibleError


PACKAGE = Path(fxckpt.__file__).resolve().parent


def _exception_classes_outside_errors(package: Path) -> list[str]:
    """``path:line Name`` of each class deriving from an exception that is defined outside
    ``errors.py``, except a private signal (``_Name``) its own module raises and catches."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where == "errors.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exceptions = {n for n, v in vars(builtins).items()
                      if isinstance(v, type) and issubclass(v, BaseException)}
        exceptions |= {n for n, v in vars(fxckpt.errors).items()
                       if isinstance(v, type) and issubclass(v, BaseException)}
        raised = {ast.unparse(n.exc).split("(")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.Raise) and n.exc is not None}
        caught = {ast.unparse(n.type) for n in ast.walk(tree)
                  if isinstance(n, ast.ExceptHandler) and n.type is not None}
        for node in ast.walk(tree):  # in source order enough: a local base is defined first
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if not bases & exceptions and not any(
                    b.endswith(("Error", "Exception", "Warning")) for b in bases):
                continue
            exceptions.add(node.name)
            signal = node.name.startswith("_") and node.name in raised and node.name in caught
            if not signal:
                found.append(f"fxckpt/{where}:{node.lineno} {node.name}")
    return found


def test_every_exception_class_is_defined_in_errors_py() -> None:
    """One home for every error: other modules import theirs from ``fxckpt.errors``
    (and re-export it where users or tests name it there). Allowed elsewhere: a private signal
    that never leaves its module (raised and caught there, e.g. cli's ``_IdsFound`` stopping a
    model at its first embedding lookup)."""
    assert _exception_classes_outside_errors(PACKAGE) == []


def test_the_exception_scan_finds_classes_defined_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "errors.py").write_text("class FxckptError(Exception):\n    pass\n")
    (tmp_path / "a.py").write_text(
        "from fxckpt.errors import ExportError\n"
        "class Bad(ExportError):\n    pass\n"
        "class Worse(Bad):\n    pass\n"
        "class OwnError(RuntimeError):\n    pass\n"
        "class _Signal(Exception):\n    pass\n"
        "class _Leaks(Exception):\n    pass\n"
        "class Plain:\n    pass\n"
        "def f():\n    try:\n        raise _Signal()\n    except _Signal:\n        pass\n"
        "    raise _Leaks()\n")
    assert _exception_classes_outside_errors(tmp_path) == [
        "fxckpt/a.py:2 Bad", "fxckpt/a.py:4 Worse", "fxckpt/a.py:6 OwnError",
        "fxckpt/a.py:10 _Leaks"]


def test_the_errors_that_moved_keep_their_old_import_paths() -> None:
    import fxckpt.cli
    import fxckpt.errors as errors
    import fxckpt.export.codec
    import fxckpt.cli.model_source
    import fxckpt.solver

    assert fxckpt.solver.BudgetInfeasible is errors.BudgetInfeasible
    assert fxckpt.export.codec.Unencodable is errors.Unencodable
    assert fxckpt.cli.CliError is errors.CliError
    assert fxckpt.cli.model_source.SourceError is errors.SourceError
    assert issubclass(errors.AfterBreakInfeasible, fxckpt.BudgetInfeasibleError)
    assert issubclass(fxckpt.BudgetInfeasibleError, errors.BudgetInfeasible)
    assert "exact search gave up after 7 steps (2 states at a cut)" in str(
        errors.Exhausted(fxckpt.solver.bounds.GaveUp(work=7, states=2)))


def _message_text(node: ast.expr) -> str:
    """The literal text of a message argument: ``{}`` for each value put in, ``""`` when the
    message is built elsewhere (a call, a name)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_text(node.left) + _message_text(node.right)
    return ""


def test_each_error_message_is_built_at_one_raise_site() -> None:
    """Two ``raise X("...")`` sites that open with the same words state one rule twice, and
    drift apart: the message belongs in one function (``fxckpt.errors.not_planned``,
    ``ExportError.hash_mismatch``, ``fxckpt.checks.check_model``) that both call. Messages
    compare on their first 40 characters, case and spacing folded, values as ``{}``."""
    package = Path(fxckpt.__file__).parent
    sites: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and node.exc.args):
                continue
            text = " ".join(_message_text(node.exc.args[0]).lower().split())[:40]
            if len(text.replace("{}", "").strip(" :;,.()")) >= 12:  # not "{}: {}"
                where = f"{path.relative_to(package.parent)}:{node.lineno}"
                sites.setdefault(text, []).append(where)
    repeated = {text: where for text, where in sites.items() if len(where) > 1}
    assert not repeated, "messages built at more than one raise site:\n" + "\n".join(
        f"{text!r}: {', '.join(where)}" for text, where in sorted(repeated.items()))
