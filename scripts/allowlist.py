"""Generate fxckpt/export/allowlist.json: what a loaded export may call, from what save writes.

    python scripts/allowlist.py            # writes fxckpt/export/allowlist.json
    python scripts/allowlist.py --check    # exits 1 if the committed file differs

Every model the test suite trains (the conformance zoo of Hugging Face architectures, the
fidelity patterns, the Python-fact patterns, torch.nn's transformer modules, the models of
tests/models.py, two pipelines) is transformed with several strategies on both captures where
they apply, saved with ``example_inputs`` (a graph for train and one for eval), and every name the
saved programs use is collected with the first model that needed it: ``call_function`` targets,
``call_method`` names (saved as ``torch.Tensor.<name>`` functions), the attribute names read with
``getattr``, leaf module classes and function-valued leaf attributes. Then the rules of
:mod:`fxckpt.export.allowlist` take out what no loaded export may call however it was made
(private ATen operators that take raw sizes, strides, offsets or indices; every ``*_backward``
operator; escape hatches such as ``untyped_storage`` and ``type``); those are written under
``refused`` with the rule that took them out, so the file shows every decision.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "fxckpt" / "export" / "allowlist.json"
Inputs = Callable[[], tuple[tuple, dict]]


def _sources() -> Iterator[tuple[str, Callable[[], torch.nn.Module], Inputs, int]]:
    """``(source name, make, inputs, depth)`` for every model the suite trains."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import models
    import patterns
    import python_patterns
    import torch_nn_patterns
    import zoo

    for case in models.CASES:
        yield f"models:{case.name}", case.make, case.inputs, case.depth
    for p in patterns.PATTERNS:
        if p.error is None:
            yield f"patterns:{p.name}", p.make, p.inputs, p.depth
    for c in [*python_patterns.CASES, *torch_nn_patterns.NN_CASES]:
        if c.error is None:
            yield f"python_patterns:{c.name}", c.make, c.inputs, c.depth
    for z in zoo.ZOO:
        yield f"zoo:{z.name}", z.make, z.inputs, z.depth
    for name, make, shape in _LAYERS:
        yield f"torch_nn:{name}", make, _inputs(shape), 1


def _inputs(shape: tuple[int, ...]) -> Inputs:
    if shape[0] < 0:  # token ids
        return lambda: ((torch.randint(0, 10, tuple(-s for s in shape)),), {})
    return lambda: ((torch.randn(*shape, requires_grad=True),), {})


def _seq(*layers: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    return lambda: torch.nn.Sequential(*(make() for make in layers))


class _First(torch.nn.Module):
    """Keeps the first output of a layer returning a tuple (recurrent layers, attention)."""

    def __init__(self, layer: torch.nn.Module, twice: bool = False) -> None:
        super().__init__()
        self.layer, self.twice = layer, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x, x)[0] if self.twice else self.layer(x)[0]


nn = torch.nn
_LAYERS: list[tuple[str, Callable[[], torch.nn.Module], tuple[int, ...]]] = [
    # the torch.nn layers users build models from, each in a small trainable stack
    ("Conv1d", _seq(lambda: nn.Conv1d(3, 4, 3), lambda: nn.BatchNorm1d(4), nn.ReLU), (2, 3, 9)),
    ("Conv2d", _seq(lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: nn.BatchNorm2d(4),
                    lambda: nn.MaxPool2d(2), lambda: nn.AdaptiveAvgPool2d(1), nn.Flatten),
     (2, 3, 8, 8)),
    ("Conv3d", _seq(lambda: nn.Conv3d(2, 3, 3), lambda: nn.BatchNorm3d(3),
                    lambda: nn.AvgPool3d(2)), (1, 2, 6, 6, 6)),
    ("ConvTranspose", _seq(lambda: nn.ConvTranspose2d(3, 2, 2, stride=2),
                           lambda: nn.GroupNorm(1, 2), lambda: nn.Upsample(scale_factor=0.5),
                           lambda: nn.PixelShuffle(1)), (2, 3, 4, 4)),
    ("ConvTranspose1d", _seq(lambda: nn.ConvTranspose1d(3, 2, 2), lambda: nn.InstanceNorm1d(2),
                             lambda: nn.AvgPool1d(2), lambda: nn.AdaptiveMaxPool1d(2)), (2, 3, 8)),
    ("Norms", _seq(lambda: nn.Linear(8, 8), lambda: nn.LayerNorm(8), lambda: nn.RMSNorm(8),
                   lambda: nn.Dropout(0.1), lambda: nn.AlphaDropout(0.1)), (4, 8)),
    ("Activations", _seq(lambda: nn.Linear(8, 8), nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
                         nn.LeakyReLU, nn.ELU, nn.Hardswish, nn.Mish, lambda: nn.PReLU(),
                         nn.Softplus, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU, nn.Softsign,
                         nn.Tanhshrink, nn.Hardsigmoid, lambda: nn.Softmax(-1),
                         lambda: nn.LogSoftmax(-1), nn.Identity), (4, 8)),
    ("Embedding", _seq(lambda: nn.Embedding(10, 8), lambda: nn.Linear(8, 8)), (-2, -5)),
    ("LSTM", lambda: nn.Sequential(_First(nn.LSTM(8, 8, batch_first=True)), nn.Linear(8, 2)),
     (2, 5, 8)),
    ("GRU", lambda: nn.Sequential(_First(nn.GRU(8, 8, num_layers=2, batch_first=True)),
                                  nn.Linear(8, 2)), (2, 5, 8)),
    ("RNN", lambda: nn.Sequential(_First(nn.RNN(8, 8)), nn.Linear(8, 2)), (5, 2, 8)),
    ("MultiheadAttention", lambda: nn.Sequential(
        nn.Linear(8, 8), _First(nn.MultiheadAttention(8, 2, batch_first=True), twice=True),
        nn.Linear(8, 2)), (2, 5, 8)),
    ("Dropout2d", _seq(lambda: nn.Conv2d(2, 2, 1), lambda: nn.Dropout2d(0.1),
                       lambda: nn.ZeroPad2d(1),
                       lambda: nn.ReflectionPad2d(1), lambda: nn.ReplicationPad2d(1)),
     (2, 2, 4, 4)),
    ("Unflatten", _seq(lambda: nn.Linear(8, 8), lambda: nn.Unflatten(1, (2, 4)),
                       lambda: nn.Dropout1d(0.1), lambda: nn.Flatten(1)), (4, 8)),
]


STRATEGIES: list[dict[str, Any]] = [
    {"every": 1},
    {"depth": None},
    {"budget": 0.7},  # selective recompute where the solver keeps nodes
    {"budget": 0.7, "selective": False},
    {"every": 1, "capture": "export"},
]
PIPELINES = ["models:mlp", "models:gpt2", "models:resnet"]


def _collect(found: dict[str, dict[str, str]], export: Path, source: str) -> None:
    from fxckpt.export.allowlist import names_used

    structure = json.loads((export / "structure.json").read_text())
    programs = [json.loads(p.read_text()) for p in sorted(export.glob("programs/**/*.json"))]
    for kind, names in names_used(structure, programs).items():
        for name in sorted(names):
            found[kind].setdefault(name, source)


def _save_all(found: dict[str, dict[str, str]], only: set[str],
              cache: Optional[Path]) -> list[str]:
    """Save every source's models and collect their names; ``cache`` keeps each source's
    names (a long run that stops can start again where it was)."""
    import fxckpt

    done: dict[str, dict[str, list[str]]] = (
        json.loads(cache.read_text()) if cache is not None and cache.exists() else {})
    failures = []
    for source, make, inputs, depth in _sources():
        if only and source not in only:
            continue
        if source in done:
            for kind, names in done[source].items():
                for name in names:
                    found[kind].setdefault(name, source)
            failures += [source] if not any(done[source].values()) else []
            continue
        mine: dict[str, dict[str, str]] = {kind: {} for kind in found}
        torch.manual_seed(0)
        args, kwargs = inputs()
        options_list = [dict(o) for o in STRATEGIES]
        if source in PIPELINES:
            options_list.append({"depth": None, "chunks": 2, "devices": ["cpu", "cpu"]})
        saved = 0
        for options in options_list:
            if "depth" in options:
                options["depth"] = depth
            try:
                tm = fxckpt.transform(make(), **options, capture="graph")
                with tempfile.TemporaryDirectory() as tmp:
                    try:  # a graph for train() and one for eval()
                        fxckpt.save(tm, Path(tmp) / "e", example_inputs=args,
                                    example_kwargs=kwargs)
                    except Exception:  # a model that raises in eval (MoE aux losses): train
                        torch.manual_seed(0)
                        tm.train()(*args, **kwargs)
                        fxckpt.save(tm, Path(tmp) / "e")
                    _collect(mine, Path(tmp) / "e", source)
                saved += 1
            except Exception as e:  # a refusal, or the model's own error in one mode
                first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
                logging.info("%s %s: %s: %s", source, options, type(e).__name__, first)
        print(f"{source}: {saved} of {len(options_list)} saved", file=sys.stderr, flush=True)
        for kind, seen in mine.items():
            for name in seen:
                found[kind].setdefault(name, source)
        if cache is not None:
            done[source] = {kind: sorted(seen) for kind, seen in mine.items()}
            cache.write_text(json.dumps(done))
        if not saved:
            failures.append(source)
    if not only or "hand:swapped_modules" in only:
        _swapped_modules(found)
    if not only or "hand:kept_nodes" in only:
        _kept_nodes(found)
    return failures


def _kept_nodes(found: dict[str, dict[str, str]]) -> None:
    """Selective recompute for sure: matmul outputs kept inside segments (keep_begin / keep_end),
    on both captures."""
    import fxckpt
    from models import MLP, gpt2

    pins = {"op:aten.addmm": "save", "op:aten.mm": "save"}
    for make, x in ((lambda: MLP(depth=3), torch.randn(8, 32)),
                    (lambda: gpt2(), torch.randint(0, 64, (2, 12)))):
        tm = fxckpt.transform(make(), every=1, force=pins, example_inputs=(x,), capture="graph")
        with tempfile.TemporaryDirectory() as tmp:
            fxckpt.save(tm, Path(tmp) / "e")
            _collect(found, Path(tmp) / "e", "hand:kept_nodes")


def _swapped_modules(found: dict[str, dict[str, str]]) -> None:
    """A torch.export graph that calls a module as it is (swapped back in through pytree specs),
    saved once the hook that made it opaque is gone: what tests/export/test_export.py
    round-trips."""
    import fxckpt
    from models import MLP
    from patterns import ExportOnly

    model = ExportOnly(MLP(depth=2), width=32)
    hook = model.inner.layers[0].fc.register_forward_hook(lambda m, i, o: None)
    tm = fxckpt.transform(model, every=1, example_inputs=(torch.randn(4, 32),), capture="graph")
    hook.remove()
    with tempfile.TemporaryDirectory() as tmp:
        fxckpt.save(tm, Path(tmp) / "e")
        _collect(found, Path(tmp) / "e", "hand:swapped_modules")


def generate(only: set[str] = set(), cache: Optional[Path] = None) -> dict[str, Any]:
    from fxckpt.export.allowlist import refusal

    found: dict[str, dict[str, str]] = {
        k: {} for k in ("functions", "getattr", "modules", "attribute_functions")}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        failures = _save_all(found, only, cache)
    out: dict[str, Any] = {
        "about": "what a loaded fxckpt export may call, generated by scripts/allowlist.py from "
                 "the exports of every model the test suite trains; each entry names the first "
                 "model that needed it, 'refused' names the rule that took an entry out",
        "torch": torch.__version__.split("+")[0],
        "unsaved": sorted(failures),
    }
    refused: dict[str, str] = {}
    for kind, names in found.items():
        kept = {}
        for name, source in sorted(names.items()):
            why = refusal(kind, name)
            if why is None:
                kept[name] = source
            else:
                refused[name] = f"{why} (seen in {source})"
        out[kind] = kept
    out["refused"] = dict(sorted(refused.items()))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file")
    parser.add_argument("--only", nargs="*", default=[], help="sources to run (for a quick try)")
    parser.add_argument("--cache", type=Path, help="keep each source's names here, and reuse them")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    data = generate(set(args.only), args.cache)
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("allowlist.json is up to date" if same else "allowlist.json differs: regenerate it")
        return 0 if same else 1
    OUT.write_text(text)
    counts = {k: len(v) for k, v in data.items() if isinstance(v, dict)}
    print(f"wrote {OUT.relative_to(ROOT)}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
