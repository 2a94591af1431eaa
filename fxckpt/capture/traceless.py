"""Capture runs the model's forward once; it must leave no trace and reveal what a graph can't
replay.

``Traceless`` wraps one capture attempt (or one run of the unmodified step on fake tensors, to
measure it). On exit it puts back everything the attempt may have changed — buffer values,
module attributes, hook tables, the random generators the model holds, the ``functools``
caches its code filled (:mod:`fxckpt.capture.caches`), and torch, numpy and
Python random state when no other thread could have drawn meanwhile (while it is active, this
thread's draws through ``random.*`` and ``np.random.*`` come from a copy of the global generator,
so those never reach the global stream) — and reports the changes that mean a captured graph
would diverge from the model:

* the forward drew from numpy's or Python's global random generator (Wav2Vec2's SpecAugment
  draws its masks with numpy): a graph would replay one draw forever;
* the forward changed a Python attribute of a module (``self.calls += 1``) or rebound a tensor
  attribute or buffer: a graph would run with the value seen while tracing;
* the forward drew from a Python or numpy random generator the model holds
  (:mod:`fxckpt.capture.generators`); its state is put back whether or not other threads run.

Attributes the forward only *adds* (``self.attn_map = attn``, a lazily built cache) are removed
again and listed in :attr:`Traceless.assigned`: capture makes the graph set them every call
(:mod:`fxckpt.runtime.assign`), sets plain values once, or refuses. Hooks the forward registers
(Hugging Face installs its output-recording hooks at the first call) are removed without
complaint: the graph computes their effect inline every call.

Hooks of the given modules are switched off while it is active, so that capture and
annotation neither fire the user's hooks on fake tensors nor bake them into the graph.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import threading
from typing import Any, Iterable, Iterator, Optional

import torch

from fxckpt.capture import generators
from fxckpt.errors import grad_mode_left
from fxckpt.capture.caches import caches_kept
from fxckpt.runtime.state import (
    alone,
    autocast_kept,
    set_torch_states,
    torch_states,
    values_kept,
)

__all__ = ["Traceless", "hooks_off"]

_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = ("_parameters", "_buffers", "_modules")
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_KEYS = frozenset(_HOOK_TABLES) | {
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_is_full_backward_hook",
}
_MISSING = object()


class Traceless:
    """Context manager around one capture attempt; ``changes`` lists what the forward changed."""

    def __init__(self, model: torch.nn.Module, quiet: Iterable[torch.nn.Module] = ()) -> None:
        self.model = model
        self.quiet = list(quiet)
        self.changes: list[str] = []
        self.assigned: list[tuple[str, str, Any]] = []
        """``(module path, name, value)`` of attributes the forward added (and that were removed
        again): the capture decides what to do with them."""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Traceless":
        # Random states are put back only when no other thread could have drawn meanwhile: a
        # capture never rewinds a data-loading or augmentation thread's random numbers.
        self._alone = alone()
        self._torch = torch_states()
        self._grad = torch.is_grad_enabled()
        self._stack.enter_context(torch.set_grad_enabled(self._grad))  # restored on exit
        self._stack.enter_context(autocast_kept())
        # buffers, and tensors kept as plain attributes (torch.export writes those for real)
        plain = [v for m in self.model.modules() for v in vars(m).values()
                 if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
        self._stack.enter_context(values_kept([*self.model.buffers(), *plain]))
        self._stack.enter_context(hooks_off(self.quiet))
        self.draws: list[str] = []
        self._stack.enter_context(_recording_draws(self.draws))
        self._stack.enter_context(caches_kept(self.model))
        self._random = random.getstate()
        self._numpy = _numpy_state()
        self._held = [(path, g, generators.state_of(g))
                      for path, g in generators.held_generators(self.model)]
        self._attrs = {
            path: _snapshot(m) for path, m in self.model.named_modules(remove_duplicate=False)
        }
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if torch.is_grad_enabled() != self._grad and exc[0] is None:
                self.changes.append(grad_mode_left("the forward", not self._grad))
            self._check_random()
            for path, generator, state in self._held:
                if not generators.same_state(generators.state_of(generator), state):
                    self.changes.append(
                        f"{generators.describe(path, generator)}, and draws from it: a graph "
                        "would replay one draw forever; draw with torch (torch.rand, or a "
                        "torch.Generator the model owns, which fxckpt replays exactly) or "
                        "outside the model")
                generators.set_state(generator, state)
            modules = dict(self.model.named_modules(remove_duplicate=False))
            for path, before in self._attrs.items():
                if path in modules:
                    self._restore(path, modules[path], before)
        finally:
            if self._alone:
                random.setstate(self._random)
                _set_numpy_state(self._numpy)
                set_torch_states(self._torch)
            self._stack.close()
            torch.clear_autocast_cache()  # fake casts made under a user's autocast must not leak

    def _check_random(self) -> None:
        # This thread's draws through the modules' functions are noted; a draw through a name
        # imported before (`from random import choice`) shows as a changed state, which only
        # this thread can have caused when it is the only one.
        where = f" ({'; '.join(dict.fromkeys(self.draws))})" if self.draws else ""
        python = any(d.startswith("random.") for d in self.draws)
        if python or (self._alone and random.getstate() != self._random):
            self.changes.append(f"the forward draws from Python's `random` module{where}")
        now = _numpy_state()
        numpy = any(d.startswith("np.random.") for d in self.draws) or (
            self._alone and now is not None and self._numpy is not None
            and not generators.same_state(now, self._numpy))
        if numpy:
            self.changes.append(f"the forward draws from numpy's global random generator{where}")

    def _restore(self, path: str, module: torch.nn.Module, before: dict[str, Any]) -> None:
        where = path or "<root>"
        after = _snapshot(module)
        for key in set(before) | set(after):
            old, new = before.get(key, _MISSING), after.get(key, _MISSING)
            if _same(old, new):
                if _other_object(old, new):
                    # An equal copy (torch.export rebuilds every dict and list attribute of every
                    # module on exit): the model's own object back, which guards and users hold.
                    _put_back(module, key, old)
                continue
            if old is not _MISSING and key not in _HOOK_KEYS:
                self.changes.append(f"the forward changes `{_name(where, key)}` "
                                    f"(from {_short(old)} to {_short(new)})")
            elif old is _MISSING and key not in _HOOK_KEYS and "." not in key:
                self.assigned.append((path, key, new.value if isinstance(new, _Sized) else new))
            _put_back(module, key, old)


def _snapshot(module: torch.nn.Module) -> dict[str, Any]:
    """Top-level attributes, plus each parameter/buffer/child entry (``_buffers.running_mean``).

    Lists, dicts and sets are recorded with their length, so one grown in place is noticed.
    """
    out: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key in _CONTAINERS:
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, (list, dict, set)):
            out[key] = _Sized(value, copy.copy(value))
        else:
            out[key] = value
    return out


class _Sized:
    """A list, dict or set attribute and a shallow copy of its contents."""

    def __init__(self, value: Any, contents: Any) -> None:
        self.value, self.contents, self.size = value, contents, len(contents)

    def put_back(self) -> Any:
        if len(self.value) != self.size:  # grown or shrunk in place: restore the contents
            if isinstance(self.value, list):
                self.value[:] = self.contents
            else:
                self.value.clear()
                self.value.update(self.contents)
        return self.value


def _same(old: Any, new: Any) -> bool:
    """Unchanged: the same object (a container of the same length), or an equal plain value."""
    if isinstance(old, _Sized) and isinstance(new, _Sized):
        if old.value is new.value:
            return old.size == new.size  # grown or shrunk in place
        return _equal(old.value, new.value)
    return old is new or _equal(old, new)


def _other_object(old: Any, new: Any) -> bool:
    if isinstance(old, _Sized) and isinstance(new, _Sized):
        return old.value is not new.value
    return old is not new


def _equal(old: Any, new: Any) -> bool:
    if type(old) is not type(new) or isinstance(old, torch.Tensor) or old is _MISSING:
        return False
    try:
        return bool(old == new)
    except Exception:  # values whose == is not a plain bool (tensors inside): treat as changed
        return False


def _put_back(module: torch.nn.Module, key: str, old: Any) -> None:
    container, _, name = key.partition(".")
    if container in _CONTAINERS and name:
        table = module.__dict__[container]
        if old is _MISSING:
            table.pop(name, None)
        else:
            table[name] = old
        return
    if old is _MISSING:
        module.__dict__.pop(key, None)
    else:
        module.__dict__[key] = old.put_back() if isinstance(old, _Sized) else old


def _name(where: str, key: str) -> str:
    container, _, name = key.partition(".")
    attr = name if container in _CONTAINERS and name else key
    return attr if where == "<root>" else f"{where}.{attr}"


def _short(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    if isinstance(value, _Sized):
        return f"a {type(value.value).__name__} of {value.size}"
    if isinstance(value, torch.Tensor):
        return f"a tensor{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def weight_computing_hooks() -> tuple[type, ...]:
    """torch's own forward pre-hooks that compute a weight from parameters every call (old-style
    ``weight_norm``): a run on fake tensors needs them, or it reads the weight the last real
    forward left behind, with that forward's autograd graph."""
    from torch.nn.utils.weight_norm import WeightNorm

    return (WeightNorm,)


@contextlib.contextmanager
def hooks_off(modules: Iterable[torch.nn.Module],
              spare: tuple[type, ...] = ()) -> Iterator[None]:
    """Switch off the modules' own hooks for the duration (they are put back on exit), except
    hooks that are instances of ``spare``."""
    saved = [(m, {t: m.__dict__[t] for t in _HOOK_TABLES}) for m in modules]
    for m, tables in saved:
        for table in _HOOK_TABLES:
            m.__dict__[table] = type(tables[table])(
                (k, h) for k, h in tables[table].items() if isinstance(h, spare))
    try:
        yield
    finally:
        for m, tables in saved:
            m.__dict__.update(tables)


_NOT_DRAWS = {
    "get_state",
    "set_state",
    "seed",
    "default_rng",
    "getstate",
    "setstate",
    "get_bit_generator",
    "set_bit_generator",
    "test",
}


@contextlib.contextmanager
def _recording_draws(draws: list[str]) -> Iterator[None]:
    """Note the call site of every numpy / ``random`` module-level draw, to name it in errors.

    This thread's draws come from a copy of the global generator, so a forward run to capture
    or measure the model leaves the global stream as it was even when other threads run (and
    the global state is not rewound); other threads draw from the real one, unnoted."""
    patched: list[tuple[Any, str, Any]] = []
    private = random.Random()
    private.setstate(random.getstate())
    modules: list[tuple[Any, str, Any]] = [(random, "random", private)]
    if "numpy" in sys.modules:
        numpy = sys.modules["numpy"]
        state = numpy.random.RandomState()
        state.set_state(numpy.random.get_state())
        modules.append((numpy.random, "np.random", state))
    thread = threading.get_ident()
    for module, label, stand_in in modules:
        for name in dir(module):
            fn = getattr(module, name)
            if (
                name.startswith("_")
                or name in _NOT_DRAWS
                or isinstance(fn, type)
                or not callable(fn)
            ):
                continue
            patched.append((module, name, fn))
            own = getattr(stand_in, name, fn)
            setattr(module, name, _noting(fn, own, f"{label}.{name}", draws, thread))
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


def _noting(fn: Any, own: Any, label: str, draws: list[str], thread: int) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:
            return fn(*args, **kwargs)
        frame = sys._getframe(1)
        draws.append(
            f"{label}() in {frame.f_code.co_name} at "
            f"{_file(frame.f_code.co_filename)}:{frame.f_lineno}"
        )
        return own(*args, **kwargs)

    return call


def _file(path: str) -> str:
    for marker in ("site-packages/", "/fxckpt/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _numpy_state() -> Optional[Any]:
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _set_numpy_state(state: Optional[Any]) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None and state is not None:
        numpy.random.set_state(state)
