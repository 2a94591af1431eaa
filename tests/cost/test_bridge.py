"""The bridge: fx -> the solver's problem on a graph small enough to work out by hand.

``Views`` traces to (float32, x of shape 3x4)::

    fc     = fc(x)            72 B   2*3*4*6 = 144 FLOPs   saves x
    view   = fc.view(2,3,3)    0 B   (alias of fc)
    t, t_1 = w.t().t()         0 B   (aliases of the parameter w: no edges)
    matmul = view @ t_1       48 B   2*2*3*3*2 = 72 FLOPs  saves fc (the view's storage)
    drop   = dropout(matmul)  48 B   random; keeps a 48 B mask no node outputs
    gt     = x > 0            12 B   bool: no gradient
    return drop, gt

cost = FLOPs + 16 per byte written (128 for random ops).
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.fx
import torch.nn as nn

from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.cost.bridge import (
    KEEP_COST,
    SAVED_COST,
    LOSS,
    SEGMENT_COST,
    SYNTHETIC,
    problem_of,
    to_networkx,
    to_problem,
)
from fxckpt.cost.prices import CALL_PRICE, CPU_PRICES, DEFAULT_PRICE, RANDOM_PRICE
from fxckpt.solver import Op, Problem, simulate

CALL = CALL_PRICE


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(3, 2))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.fc(x).view(2, 3, 3) @ self.w.t().t()
        return self.drop(m), x > 0


@pytest.fixture(scope="module")
def gm() -> torch.fx.GraphModule:
    x = torch.randn(3, 4)
    captured = capture(Views(), (x,), {})
    return annotate(captured.gm, [x])


@pytest.fixture(scope="module")
def view(gm: torch.fx.GraphModule) -> nx.DiGraph:
    return to_networkx(gm)


def test_constants_are_the_documented_ones() -> None:
    assert (SEGMENT_COST, KEEP_COST, SAVED_COST) == (3e7, 1e7, 1.5e6)
    assert (SYNTHETIC, LOSS) == ("::saved", "loss::assumed")


def test_nodes_bytes_costs_and_saves(view: nx.DiGraph) -> None:
    ops = {n: d for n, d in view.nodes(data=True) if d["kind"] == "op"}
    assert [n for n, d in sorted(ops.items(), key=lambda kv: kv[1]["position"])] == [
        "fc", "view", "t", "t_1", "matmul", "drop", "gt"]
    facts = {n: (d["out_bytes"], d["cost"], d["saves"], d["internal"], d["grad"])
             for n, d in ops.items()}
    # FLOPs, plus a price per aten call, plus bytes written at the op's price: views are free,
    # allocations write nothing, addmm and mm are priced by their FLOPs; dropout is empty_like,
    # bernoulli_ (random), div_ and mul.
    assert facts == {
        "fc": (72, 144 + CALL, ("x",), 0, 72),  # t, addmm
        "view": (0, 0.0, (), 0, 0),
        "t": (0, 0.0, (), 0, 0),
        "t_1": (0, 0.0, (), 0, 0),
        "matmul": (48, 72 + CALL, ("fc",), 0, 48),  # view, mm, _unsafe_view
        "drop": (48, 4 * CALL + (RANDOM_PRICE + 2 * DEFAULT_PRICE) * 48, (), 48, 48),
        "gt": (12, CALL + CPU_PRICES["gt"] * 12, (), 0, 0),
    }
    assert view.nodes["x"] == {"kind": "input", "out_bytes": 0, "cost": 0.0, "saves": (),
                               "internal": 0}
    assert (ops["fc"]["module_path"], ops["drop"]["module_path"], ops["gt"]["module_path"]) \
        == ("fc", "drop", "")


def test_edges_follow_storage_owners(view: nx.DiGraph) -> None:
    # matmul reads the view of fc: the edge comes from fc. Views of the parameter w have a
    # get_attr root, which is not in the view: no edge into t, t_1 or from them.
    assert set(view.edges) == {("x", "fc"), ("x", "gt"), ("fc", "view"), ("fc", "matmul"),
                               ("matmul", "drop")}
    assert view.graph["outputs"] == ("drop", "gt")
    assert "w" not in view


def test_problem_has_one_op_per_node_a_synthetic_mask_and_the_loss(view: nx.DiGraph) -> None:
    problem = to_problem(view)
    assert problem == Problem(ops=(
        # saved_tensors: what autograd's pack hook received for the node (x for the weight's
        # gradient; mm: both operands; dropout: its mask)
        Op(name="fc", out_bytes=72, cost=144 + CALL, inputs=("x",), saves=("x",),
           grad_bytes=72, saved_tensors=1),
        Op(name="view", out_bytes=0, cost=0.0, inputs=("fc",), grad_bytes=0),
        Op(name="t", out_bytes=0, cost=0.0, grad_bytes=0),
        Op(name="t_1", out_bytes=0, cost=0.0, grad_bytes=0),
        Op(name="matmul", out_bytes=48, cost=72 + CALL, inputs=("fc",), saves=("fc",),
           grad_bytes=48, saved_tensors=2),
        Op(name="drop::saved", out_bytes=48, cost=0.0, grad_bytes=0, hidden=True),
        Op(name="drop", out_bytes=48, cost=4 * CALL + (RANDOM_PRICE + 2 * DEFAULT_PRICE) * 48,
           inputs=("matmul",), saves=("drop::saved",), grad_bytes=48, saved_tensors=1),
        Op(name="gt", out_bytes=12, cost=CALL + CPU_PRICES["gt"] * 12, inputs=("x",),
           grad_bytes=0),
        # as large as the floating outputs' gradients: drop's 48 bytes (gt is bool)
        Op(name=LOSS, out_bytes=48, cost=0.0, inputs=("drop", "gt"), saves=(LOSS,),
           grad_bytes=0),
    ), outputs=(LOSS,), segment_overhead=SEGMENT_COST, keep_overhead=KEEP_COST,
        saved_overhead=SAVED_COST, early_stop=True,
        # the reserve for temporaries: the largest gradient (fc's 72 bytes; no kernel scratch)
        reserve_bytes=72)
    assert problem.graph_inputs == ("x",)


def test_problem_of_is_to_problem_of_to_networkx(gm: torch.fx.GraphModule) -> None:
    assert problem_of(gm) == to_problem(to_networkx(gm))


def test_simulated_step_of_the_bridge_problem(gm: torch.fx.GraphModule) -> None:
    """Live bytes per step, worked out from the simulator's rules (graph inputs count 0).

    fc lives until matmul's backward (matmul saves it), the mask until drop's backward, the
    loss (which saves itself) until its own backward; gradients: drop 48, matmul 48, fc 72.
    """
    sim = simulate(problem_of(gm))
    assert [live for _, live in sim.timeline] == [
        72, 72, 72, 72,  # forward fc, view, t, t_1
        120, 168, 216,   # matmul, drop::saved (the mask), drop
        180,             # gt: matmul's last reader ran
        228,             # loss: fc, mask, drop, gt, loss
        168,             # backward start: fc, mask, loss
        216, 168, 216,   # backward loss (+grad drop), gt, drop (+grad matmul)
        120, 192,        # backward drop::saved, matmul (+grad fc)
        72, 72, 72, 72,  # backward t_1, t, view, fc
    ]
    # the peaks count the problem's reserve (fc's 72-byte gradient); the timeline does not
    assert (sim.peak_bytes, sim.forward_peak, sim.reserve_bytes) == (300, 300, 72)
