"""planning/overlap.py: ``offload="auto"`` where copies run beside the compute (a GPU's side
stream). Offloaded segments cost only their overhead and hooks, for as many bytes as the host
link moves while the forward runs; the plan is searched without offload and at prices around
the one that fills that room, and the plan that recomputes least is taken."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import torch

import fxckpt
from fxckpt.planning import overlap
from fxckpt.planning.overlap import assign, capacity, cost, overlapped, price
from fxckpt.solver import Op, Problem


def _problem(per_byte: float | None = 32.0, keep_overhead: float = 0.0) -> Problem:
    """``a .. f -> loss``, 100-byte outputs each saved by the next op. Forward 1600: ``c``
    (1000) and ``e`` (560) are dear to run again, the rest cost 10. At 32 a byte out and back
    the link moves 100 bytes in the forward's time."""
    costs = {"a": 10, "b": 10, "c": 1000, "d": 10, "e": 560, "f": 10}
    ops, previous = [], "x"
    for name, c in costs.items():
        ops.append(Op(name=name, out_bytes=100, cost=c, inputs=(previous,), saves=(previous,)))
        previous = name
    ops.append(Op(name="loss", out_bytes=4, cost=0, inputs=("f",), saves=("f",), grad_bytes=0))
    return Problem(ops=tuple(ops), outputs=("loss",), offload_cost_per_byte=per_byte,
                   segment_overhead=5.0, keep_overhead=keep_overhead)


AB, C, E, DE = (0, 2), (2, 3), (4, 5), (3, 5)


def test_the_room_is_the_forward_over_a_byte_s_trip_out() -> None:
    assert capacity(_problem(32.0)) == 100      # 1600 / (32 / 2)
    assert capacity(_problem(16.0)) == 200      # twice the link, twice the bytes
    assert capacity(_problem(None)) == 0        # a problem that does not offload moves nothing


def test_a_segment_moves_what_its_ops_save_as_the_offloader_s_hooks_see_it() -> None:
    problem = _problem()
    # each op saves its input: [a, b] moves a (a saves the graph input x, which is no op);
    # c moves b, made before it; [c, d, e] moves b, c and d
    assert [overlap.moved(problem, s) for s in (AB, C, E, DE, (2, 5))] == [100, 100, 100, 200,
                                                                           300]
    assert overlap.moved(problem, (0, 7)) == 600   # loss saves f: every op's output once


def test_the_most_recompute_per_byte_offloads_first_within_the_room() -> None:
    problem = _problem()
    ranges = (AB, C, E)                          # recompute per byte: 0.2, 10, 5.6
    assert assign(problem, ranges, (), 0) == [False, False, False]
    assert assign(problem, ranges, (), 100) == [False, True, False]
    assert assign(problem, ranges, (), 150) == [False, True, False]   # e does not fit too
    assert assign(problem, ranges, (), 200) == [False, True, True]
    assert assign(problem, ranges, (), 10_000) == [True, True, True]


def test_a_segment_that_does_not_fit_is_passed_over_for_a_smaller_one() -> None:
    problem = _problem()
    # [a, b, c] moves 200 bytes at 5.1 a byte, e 100 at 5.6: with 250 bytes of room e goes
    # first; [a, b, c] no longer fits, and the rest of the room is left empty
    assert assign(problem, ((0, 3), E), (), 250) == [False, True]
    assert assign(problem, ((0, 3), E), (), 300) == [True, True]


def test_an_offloaded_segment_costs_its_overhead_and_a_recomputed_one_its_ops() -> None:
    problem = _problem()
    ranges = (AB, C, E)
    assert cost(problem, ranges, (), [False, False, False]) == 3 * 5 + 20 + 1000 + 560
    assert cost(problem, ranges, (), [False, True, False]) == 3 * 5 + 20 + 560
    assert cost(problem, ranges, (), [True, True, True]) == 3 * 5


def test_a_kept_op_is_not_recomputed_and_so_not_worth_moving() -> None:
    problem = _problem(keep_overhead=4.0)
    # keeping e (position 4) saves 560 - 4 of the segment [d, e]: it recomputes d only
    assert cost(problem, (DE,), (4,), [False]) == 5 + 10 + 4
    # e's gain left, [d, e] recomputes 14 for 200 bytes; c 1000 for 100: c goes first
    assert assign(problem, (DE, C), (4,), 100) == [False, True]


def test_the_price_is_the_first_segment_past_the_room_most_per_byte_first() -> None:
    problem = _problem()
    assert price(problem, (AB, C, E), (), 100) == pytest.approx(5.6)   # e is past the room
    assert price(problem, (AB, C, E), (), 200) == pytest.approx(0.2)   # then [a, b]
    assert price(problem, (AB, C, E), (), 10_000) == pytest.approx(0.1)  # all fit: half the last
    assert price(problem, (), (), 100) is None


def test_the_search_lays_a_plan_without_offload_and_at_the_price_and_takes_the_cheapest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    problem = _problem()
    seen: list[Any] = []
    plans = {None: (AB, C, E), 2.8: ((0, 3), E), 5.6: (C, DE), 11.2: (C,)}

    def lay(priced: Problem) -> Any:
        seen.append(priced.offload_cost_per_byte)
        return priced.offload_cost_per_byte

    def extent(at: Any) -> Any:
        return plans[None if at is None else round(at, 1)], ()

    # the plan without offload, (AB, C, E), puts e past the room of 100 bytes: price 5.6
    found = overlapped(problem, lay, extent)
    assert seen == [None, pytest.approx(5.6)] and found.tried == 2
    # costs with 100 bytes of room: (AB,C,E) 15+20+560 (c offloads); (C, DE) 10+570
    assert found.laid == pytest.approx(5.6) and found.offloads == (True, False)
    assert found.cost == 580 and found.moved == 100 and found.room == 100
    assert found.price == pytest.approx(5.6)
    # at more prices the cheapest of all is taken: (C,) at twice the price costs 5
    monkeypatch.setattr(overlap, "PRICE_STEPS", (0.5, 1.0, 2.0))
    seen.clear()
    found = overlapped(problem, lay, extent)
    assert seen[0] is None and seen[1:] == pytest.approx([2.8, 5.6, 11.2])
    assert found.laid == pytest.approx(11.2) and found.cost == 5 and found.tried == 4
    # the plan without offload wins when nothing priced is cheaper: (AB, C, E) beats ((0,3),E)
    monkeypatch.setattr(overlap, "PRICE_STEPS", (0.5,))
    found = overlapped(problem, lay, extent)
    assert found.laid is None and found.price is None and found.cost == 15 + 20 + 560


def test_without_search_or_without_room_the_plan_is_laid_once() -> None:
    calls: list[Any] = []

    def lay(priced: Problem) -> Any:
        calls.append(priced.offload_cost_per_byte)
        return (AB, C, E)

    found = overlapped(_problem(), lay, lambda r: (r, ()), search=False)
    assert calls == [None] and found.offloads == (False, True, False) and found.tried == 1
    calls.clear()
    found = overlapped(_problem(None), lay, lambda r: (r, ()))
    assert calls == [None] and found.offloads == (False, False, False) and found.room == 0
    assert overlap.PRICE_STEPS == (1.0,)


def _mlp(device: str = "meta", layers: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return torch.nn.Sequential(*(m for _ in range(layers) for m in (
            torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Dropout(0.1))))


def _room_and_moved(plan: Any) -> tuple[float, float]:
    for note in plan.notes:
        m = re.search(r"offload ([0-9.]+) MiB, within the ([0-9.]+) MiB the host link", note)
        if m:
            return float(m.group(2)), float(m.group(1))
    raise AssertionError(plan.notes)


def test_a_gpu_plan_offloads_within_the_room_and_recomputes_less_than_without_offload(
        ) -> None:
    x = torch.empty(2048, 256, device="meta")
    common: dict[str, Any] = dict(budget=0.5, device_profile="h100", example_inputs=(x,))
    plain = fxckpt.inspect(fxckpt.transform(_mlp(), **common)).plan
    plan = fxckpt.inspect(fxckpt.transform(_mlp(), offload="auto", offload_device="cpu",
                                           offload_bandwidth=4e11, **common)).plan
    room, moved = _room_and_moved(plan)
    offloaded = [s for s in plan.segments if s.action == "offload"]
    assert offloaded and 0 < moved <= room
    assert plan.peak_bytes <= 0.5 * plan.eager_peak_bytes
    # the plan without offload is one of those searched: moving bytes for free only lowers it
    assert plan.recompute_share < plain.recompute_share
    # an offloaded segment recomputes nothing: the share is what the recomputed ones run; the
    # floor is the floor at the peak plus the room, under the plain plan's
    assert 0 <= plan.recompute_floor <= plan.recompute_share
    assert plan.recompute_floor <= plain.recompute_floor


def test_a_cpu_plan_still_prices_each_byte_s_trip() -> None:
    x = torch.randn(256, 256)
    tm = fxckpt.transform(_mlp("cpu", 4), budget=0.5, offload="auto", offload_device="cpu",
                          example_inputs=(x,))
    notes = fxckpt.inspect(tm).plan.notes
    assert any(n.startswith("offload='auto': ") and "moving a byte costs" in n for n in notes)
    assert not any("beside the compute" in n for n in notes)


@pytest.mark.parametrize("capture", ["auto", "graph"])
def test_a_plan_made_for_a_gpu_runs_on_the_cpu_with_the_same_bits(capture: str) -> None:
    """The h100's plan with offloaded segments, run here (the offloader's copies are then
    synchronous), on both capture paths: outputs, gradients and the parameters after SGD steps
    equal the model's."""
    model = _mlp("cpu", 6)
    # at 50 GB/s the link moves one of the plan's two segments behind the forward
    tm = fxckpt.transform(_mlp("cpu", 6), budget=0.5, offload="auto", offload_device="cpu",
                          offload_bandwidth=5e10, device_profile="h100", capture=capture)
    tm.load_state_dict(model.state_dict())
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(tm.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2048, 256, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(step)
        a = model(x)
        torch.manual_seed(step)
        b = tm(x)
        assert torch.equal(a, b)
        a.square().mean().backward()
        b.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), tm.parameters()):
            assert torch.equal(p.grad, q.grad), name
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
    plan = fxckpt.inspect(tm).plan
    assert any(s.action == "offload" for s in plan.segments)
    assert any(s.action == "recompute" for s in plan.segments)
    assert fxckpt.inspect(tm).offload_stats.bytes_moved > 0
    for p, q in zip(model.parameters(), tm.parameters()):
        assert torch.equal(p, q)


def _every_plan(n: int) -> list[tuple[tuple[int, int], ...]]:
    """Every set of segments over ops ``0..n-1``: each contiguous piece of a partition is a
    segment or not."""
    plans = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append((start, i))
                start = i
        pieces.append((start, n))
        for chosen in itertools.product([False, True], repeat=len(pieces)):
            plans.append(tuple(p for p, c in zip(pieces, chosen) if c))
    return plans


@pytest.mark.parametrize("room", [100, 200, 300])
def test_no_plan_that_offloads_within_the_room_beats_the_floor_at_its_peak_plus_the_room(
        room: int) -> None:
    """The floor a plan with copies beside the compute states (select's ``_beside``): every
    segmentation and every offload choice within the room, searched exhaustively."""
    from fxckpt.solver import simulate
    from fxckpt.solver.floor import recompute_floor

    problem = _problem(per_byte=None)
    ix, seen = problem.index, 0
    best: dict[int, float] = {}  # least cost at each peak reached
    for ranges in _every_plan(ix.n):
        peak = simulate(problem, ranges, ()).peak_bytes
        moved = [overlap.moved(problem, span) for span in ranges]
        for offloads in itertools.product([False, True], repeat=len(ranges)):
            if sum(m for m, o in zip(moved, offloads) if o) > room:
                continue
            seen += 1
            price = cost(problem, ranges, (), offloads)
            best[peak] = min(price, best.get(peak, math.inf))
    assert seen > 1000
    least = {peak: min(c for p, c in best.items() if p <= peak) for peak in best}
    for peak in best:
        assert least[peak] >= recompute_floor(problem, peak + room) - 1e-9, (peak, room)
    # and with room for two ops' outputs the plain floor is no bound: offloading beats it
    assert room < 200 or any(least[peak] < recompute_floor(problem, peak) for peak in best)
