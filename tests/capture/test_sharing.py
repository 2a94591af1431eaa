"""capture/sharing.py: captures offered to every transform of one model object, while the
model holds the same modules and tensors, at most ``limit`` of them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fxckpt.capture.sharing import fingerprint, offer, shared_capture


def _captured(method: str = "symbolic_trace", accepts: bool = True,
              failure: str | None = None) -> SimpleNamespace:
    """What shared_capture asks of a capture."""
    return SimpleNamespace(method=method, accepts=lambda shapes: accepts,
                           guards=SimpleNamespace(failure=lambda: failure))


def test_the_fingerprint_changes_when_a_module_or_tensor_is_replaced() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    seen = fingerprint(model)
    assert len(seen) == 2 + 4 + 3  # submodules, parameters, buffers
    assert fingerprint(model) == seen
    model[0].weight = torch.nn.Parameter(torch.ones(2, 2))
    assert fingerprint(model) != seen


def test_a_capture_offered_is_found_for_the_same_key_and_fingerprint() -> None:
    model = torch.nn.Linear(2, 2)
    seen, made = fingerprint(model), _captured()
    offer(model, "key", seen, made, limit=4)
    assert shared_capture(model, "key", ((3, 2),), seen, "auto") is made
    assert shared_capture(model, "key", ((3, 2),), seen, "symbolic_trace") is made
    assert shared_capture(model, "other key", ((3, 2),), seen, "auto") is None
    assert shared_capture(model, "key", ((3, 2),), (1, 2), "auto") is None
    assert shared_capture(torch.nn.Linear(2, 2), "key", ((3, 2),), seen, "auto") is None


def test_a_capture_of_another_method_shape_or_failed_guard_is_not_reused() -> None:
    model = torch.nn.Linear(2, 2)
    seen = fingerprint(model)
    for captured in (_captured(method="export"), _captured(accepts=False),
                     _captured(failure="temperature changed")):
        offer(model, "key", seen, captured, limit=8)
    assert shared_capture(model, "key", ((3, 2),), seen, "symbolic_trace") is None
    assert shared_capture(model, "key", ((3, 2),), seen, "export") is not None  # the first


def test_the_oldest_beyond_the_limit_is_no_longer_offered() -> None:
    model = torch.nn.Linear(2, 2)
    seen = fingerprint(model)
    first, second, third = _captured(), _captured(), _captured()
    offer(model, "a", seen, first, limit=2)
    offer(model, "b", seen, second, limit=2)
    offer(model, "b", seen, third, limit=2)
    assert shared_capture(model, "a", (), seen, "auto") is None
    assert shared_capture(model, "b", (), seen, "auto") is second
