"""capture/reads.py: what a forward read and wrote while captured, on this thread only."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

from fxckpt.capture.reads import Reads, is_plain, recording


class Scaled(nn.Module):
    kind = "linear"  # a class attribute

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.scale = 0.5
        self.unused = 3
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.fc(x) * self.scale if self.kind == "linear" else x


def test_plain_values_are_compared_by_what_they_hold() -> None:
    assert is_plain(1) and is_plain(-0.0) and is_plain(torch.float16) and is_plain(None)
    assert is_plain([1, (2, "a")]) and is_plain({"k": [torch.Size([2, 3])]})
    assert not is_plain([1, object()]) and not is_plain({1: torch.zeros(1)})
    assert not is_plain(nn.ReLU())


def test_reads_and_writes_of_the_forward_are_noted_and_the_class_put_back() -> None:
    model = Scaled()
    with recording(list(model.modules())) as reads:
        assert type(model) is not Scaled and isinstance(model, Scaled)
        model(torch.randn(1, 2))
    assert type(model) is Scaled and type(model.fc) is nn.Linear
    obj, values, class_reads = reads.objects[id(model)]
    assert obj is model
    assert values == {"scale": 0.5, "calls": 0}  # read before it was set; "unused" never read
    assert class_reads == {"kind"}  # an instance attribute could shadow it
    assert [(o is model, name, before, now) for o, name, before, now in reads.changed()] == \
        [(True, "calls", 0, 1)]


def test_setting_an_attribute_to_the_value_it_had_is_not_a_change() -> None:
    reads, obj = Reads(), Scaled()
    reads.note_write(obj, "scale", 0.5)
    reads.note_write(obj, "new_name", 1)  # not there before: nothing to put back
    assert reads.changed() == []
    reads.note_write(obj, "scale", 0.25)
    assert [(name, before, now) for _, name, before, now in reads.changed()] == \
        [("scale", 0.5, 0.25)]


def test_forget_drops_a_read_and_of_type_finds_reads_by_kind() -> None:
    model = Scaled()
    model.table = {"a": 1}
    reads = Reads()
    for name in ("scale", "table", "kind"):
        reads.note(model, name, getattr(model, name))
    assert reads.of_type(dict) == ["Scaled.table"] and reads.of_type(float) == ["Scaled.scale"]
    reads.forget(model, "scale")
    reads.forget(model, "kind")
    _, values, class_reads = reads.objects[id(model)]
    assert values == {"table": {"a": 1}} and class_reads == set()


def test_another_thread_reading_the_same_model_is_not_recorded() -> None:
    model = Scaled()
    seen: list[float] = []
    with recording([model]) as reads:
        t = threading.Thread(target=lambda: seen.append(model.scale))
        t.start()
        t.join()
    assert seen == [0.5] and id(model) not in reads.objects
