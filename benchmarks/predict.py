"""Predicted GPU step times, planned on the CPU: fxckpt against hand-placed checkpointing.

    python -m benchmarks.predict [--model llama3-8b] [--profile h100] [--layers 32] [--out docs]

Llama-3-8B (hidden 4096, 32 layers, 32 heads and 8 key/value heads, intermediate 14336, vocab
128256), sequence 4096, batch 1, or Llama-3.2-1B (hidden 2048, 16 layers, 32 and 8 heads,
intermediate 8192, tied embeddings), sequence 2048, batch 4 (torchtitan's memory-policy run),
bf16, built on the ``meta`` device: nothing is allocated and every number is deterministic.
Each method is an fxckpt plan of the same captured graph, verified on fake tensors and priced
with a device profile (:mod:`fxckpt.cost.devices`):

* *unmodified*: no segment;
* *per-block*: each decoder layer one segment (``depth=3``), as ``torch.utils.checkpoint``
  around every layer;
* *op policy*: each layer a segment keeping every linear and attention output (torchtitan's
  selective activation checkpointing policy; attention is planned as the fused kernel an H100
  runs, :mod:`fxckpt.cost.fused_attention`);
* *Megatron selective*: each layer a segment keeping every linear output, recomputing the
  attention core and the pointwise ops;
* *fxckpt 0.5* (*fxckpt 0.66* for the 1B): the solver at that share of the unmodified peak;
  *fxckpt 0.5 + offload*: the same with ``offload="auto"``, whose copies to the host run beside
  the compute on a GPU (:mod:`fxckpt.planning.overlap`): a segment offloaded recomputes nothing,
  as long as the bytes moved fit in what the host link moves while the forward runs;
  *fxckpt @peer*: the solver at each peer's peak.

With ``--exact`` (a few layers: the search is exponential in what stays live), the solver is
also checked against the optimum on the same problem (:func:`exact_check`): the model's priced
problem at the budget's share of its simulated unmodified peak, solved by fxckpt's search
(kept outputs included), by the exact search over every segmentation (no kept outputs,
:func:`fxckpt.solver.search.search` with no limit on its work), and bounded by the recompute
floor. It says which side of the gap between a plan and its floor is loose.

The predicted step is the forward, the backward (twice the forward: two matmuls per matmul),
the recompute the plan states (with the profile's price per kept node) and the profile's
overhead per segment. These are predictions from a cost model, not measurements:
``docs/gpu.md`` keeps them apart from what ``scripts/gpu_check.sh`` measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

__all__ = ["LLAMA3_8B", "LLAMA3_1B", "MODELS", "Predicted", "Exact", "predict", "exact_check",
           "render", "render_exact", "main"]

LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
}


LLAMA3_1B: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": True,
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One predicted model: its config, the input it is planned for and the budget asked."""

    title: str
    config: dict[str, Any]
    batch: int
    seq: int
    fraction: float


MODELS = {
    "llama3-8b": Setup("Llama-3-8B", LLAMA3_8B, 1, 4096, 0.5),
    "llama3-1b": Setup("Llama-3.2-1B", LLAMA3_1B, 4, 2048, 0.66),
}


@dataclasses.dataclass(frozen=True)
class Predicted:
    method: str
    peak_bytes: int
    step_seconds: float
    recompute_share: float
    segments: int
    kept: int
    floor: float = 0.0
    """The plan's recompute floor (``Plan.recompute_floor``): no plan at its peak goes under."""
    floor_step: float = 0.0
    """The step at that floor, with one segment's overhead: no plan at this peak is faster."""
    offloaded: int = 0
    """Segments whose saved tensors go to the host (``offload="auto"``) instead of recomputing."""
    note: str = ""
    """What the plan says about its offload, when it may offload."""


def _model(config: dict[str, Any], layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    options: dict[str, Any] = dict({"tie_word_embeddings": False}, **config)
    options.update(num_hidden_layers=layers, use_cache=False, attn_implementation="sdpa")
    cfg = LlamaConfig(**options)
    with torch.device("meta"):
        model: torch.nn.Module = LlamaForCausalLM(cfg)
        return model.to(torch.bfloat16).train()


def predict(profile_name: str = "h100", layers: Optional[int] = None,
            seq: Optional[int] = None, model: str = "llama3-8b"
            ) -> tuple[list[Predicted], dict[str, Any]]:
    """Every method's predicted peak and step time (see the module docstring)."""
    import fxckpt
    from fxckpt.module import dispatcher_of
    from fxckpt.cost.annotate import has_info, info
    from fxckpt.cost.devices import PROFILES
    from fxckpt.cost.bridge import problem_of

    profile = PROFILES[profile_name]
    assert profile is not None, "a GPU profile"
    setup = MODELS[model]
    layers = setup.config["num_hidden_layers"] if layers is None else layers
    seq = setup.seq if seq is None else seq
    built = _model(setup.config, layers)
    ids = torch.zeros(setup.batch, seq, dtype=torch.long, device="meta")
    start = time.perf_counter()

    def plan(**options: Any) -> Any:
        try:
            tm = fxckpt.transform(built, example_inputs=(ids,), device_profile=profile_name,
                                  verify=True, **options)
        except fxckpt.BudgetInfeasibleError as e:  # a small config: its smallest feasible peak
            tm = fxckpt.transform(built, example_inputs=(ids,), device_profile=profile_name,
                                  verify=True, **dict(options, budget=e.min_budget))
        return dispatcher_of(tm).last

    base = plan()
    gm = base.gm
    forward = sum(op.cost for op in problem_of(gm, profile).ops) / profile.unit
    # Linear layers run as aten.mm in the captured graph; attention as the GPU's fused kernel
    # (planned so on the meta device for a GPU profile), or as its math (bmm, softmax, bmm).
    attention = sorted({c.rsplit(".", 1)[0] for n in gm.graph.nodes if has_info(n)
                        for c in info(n).calls if "scaled_dot_product" in c or ".bmm." in c})
    linear = {"op:aten.mm": "save"}
    methods: dict[str, dict[str, Any]] = {
        "per-block": {"depth": 3},
        "op policy": {"depth": 3, "force": dict(linear, **{f"op:{a}": "save" for a in attention})},
        "Megatron selective": {"depth": 3, "force": linear},
        f"fxckpt {setup.fraction:g}": {"budget": setup.fraction},
        f"fxckpt {setup.fraction:g} + offload": {"budget": setup.fraction, "offload": "auto",
                                                 "offload_device": "cpu"},
    }
    rows = [_row("unmodified", base.plan, forward, profile)]
    for name, options in methods.items():
        rows.append(_row(name, plan(**options).plan, forward, profile))
    for peer in [r for r in rows if r.method in ("per-block", "op policy", "Megatron selective")]:
        rows.append(_row(f"fxckpt @{peer.method}", plan(budget=peer.peak_bytes).plan, forward,
                         profile))
    facts = {"profile": profile_name, "layers": layers, "seq": seq, "model": model,
             "title": setup.title, "batch": setup.batch,
             "forward_seconds": forward, "seconds": time.perf_counter() - start,
             "attention_ops": attention}
    return rows, facts


@dataclasses.dataclass(frozen=True)
class Exact:
    """fxckpt's search against the exact optimum over segmentations on one problem, in shares
    of one forward pass: what each plan adds to a step at the profile's prices (its recompute,
    its saved tensors' hooks and its segments' overhead, less what kept outputs save), and the
    least any plan at that peak adds (:func:`fxckpt.solver.floor.recompute_floor`)."""

    layers: int
    fraction: float
    ops: int
    eager_bytes: int
    """The problem's simulated unmodified peak; the budget is ``fraction`` of it."""
    search: float
    search_segments: int
    search_kept: int
    search_seconds: float
    optimum: Optional[float]
    """The cheapest plan of segments alone (``None``: none fits)."""
    optimum_seconds: float
    floor: float


def exact_check(profile_name: str = "h100", layers: int = 6, fraction: Optional[float] = None,
                seq: Optional[int] = None, model: str = "llama3-8b") -> Exact:
    """fxckpt's search, the exact search over segmentations and the floor on ``model`` with
    ``layers`` layers, at ``fraction`` (default: the model's) of its simulated unmodified peak.

    The problem is the one a budget plan solves (priced with the profile); the budget is a
    share of the simulator's peak, not the verified one, so a few layers reach shares a verified
    budget refuses (weight gradients and the loss are a large part of a short model's step)."""
    import fxckpt
    from fxckpt.capture.graphs import planned_nodes
    from fxckpt.cost.bridge import problem_of
    from fxckpt.cost.devices import PROFILES
    from fxckpt.module import dispatcher_of
    from fxckpt.planning.blocks import block_ranges
    from fxckpt.planning.keeps import choices
    from benchmarks.solver_graphs import exact_optimum
    from fxckpt.solver import simulate
    from fxckpt.solver.floor import recompute_floor
    from fxckpt.solver.portfolio import solve_plan

    setup = MODELS[model]
    fraction = setup.fraction if fraction is None else fraction
    ids = torch.zeros(setup.batch, setup.seq if seq is None else seq, dtype=torch.long,
                      device="meta")
    built = _model(setup.config, layers)
    compiled = dispatcher_of(fxckpt.transform(built, example_inputs=(ids,),
                                              device_profile=profile_name)).last
    assert compiled is not None
    order = planned_nodes(compiled.gm.graph)
    problem = problem_of(compiled.gm, PROFILES[profile_name])
    eager = simulate(problem, ()).peak_bytes
    target = int(fraction * eager)
    start = time.perf_counter()
    sel = solve_plan(problem, target, block_ranges(problem, order),
                     choices(problem, order, {})[0], [])
    took = time.perf_counter() - start
    planned = simulate(problem, sel.segments, sel.keep)
    assert planned.peak_bytes <= target
    start = time.perf_counter()
    found = exact_optimum(problem, target)
    searched = time.perf_counter() - start
    forward = problem.index.cum_cost[-1]
    optimum = None
    if found is not None:
        assert simulate(problem, found.segments).peak_bytes <= target
        optimum = simulate(problem, found.segments).recompute_cost / forward
    return Exact(layers, fraction, len(problem.ops), eager, planned.recompute_cost / forward,
                 len(sel.segments), len(sel.keep), took, optimum, searched,
                 recompute_floor(problem, target) / forward)


def _row(method: str, plan: Any, forward: float, profile: Any) -> Predicted:
    kept = sum(len(s.keeps) for s in plan.segments)
    # The recompute share already holds each kept node's bookkeeping (a kept op saves its cost
    # less the profile's keep price); the per-segment overhead is left out of it.
    step = forward * (3 + plan.recompute_share) + len(plan.segments) * profile.segment
    peak = plan.peak_bytes if plan.segments else (plan.eager_peak_bytes or plan.peak_bytes)
    floor = plan.recompute_floor or 0.0
    floor_step = forward * (3 + floor) + (profile.segment if floor else 0.0)
    offloaded = sum(s.action == "offload" for s in plan.segments)
    note = next((n for n in plan.notes if n.startswith("offload='auto'")), "")
    return Predicted(method, int(peak), step, plan.recompute_share, len(plan.segments), kept,
                     floor, floor_step, offloaded, note)


def render(rows: list[Predicted], facts: dict[str, Any]) -> str:
    base = rows[0]
    lines = [
        f"### {facts['title']} predicted on an {facts['profile'].upper()} (planned on the CPU, "
        "not measured)",
        "",
        f"*Generated by `python -m benchmarks.predict --profile {facts['profile']} "
        f"--model {facts['model']}` in {facts['seconds']:.0f} s.* {facts['title']} "
        f"({facts['layers']} layers), sequence {facts['seq']}, batch {facts['batch']}, bf16, on "
        "the meta device; every plan verified on fake "
        f"tensors and priced with the `{facts['profile']}` profile. The forward alone is "
        f"predicted at {facts['forward_seconds'] * 1e3:.0f} ms; a step is the forward, twice "
        "that for the backward, the plan's recompute and its overheads.",
        "",
        "| method | segments | kept outputs | peak | recompute | predicted step | vs unmodified "
        "| floor | step at the floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.segments} | {r.kept} | {r.peak_bytes / 2**30:.1f} GiB "
            f"({r.peak_bytes / base.peak_bytes:.2f}) | {r.recompute_share:.0%} | "
            f"{r.step_seconds * 1e3:.0f} ms | {r.step_seconds / base.step_seconds:.3f}x | "
            f"{r.floor:.0%} | {r.floor_step / base.step_seconds:.3f}x |")
    by = {r.method: r for r in rows}
    for r in rows:
        if r.note:
            lines += ["", f"*{r.method}*: {r.offloaded} of {r.segments} segments offload. "
                      f"The plan's note: \"{r.note}\"."]
    lines += ["", "At each peer's peak, fxckpt's predicted step against the peer's:", ""]
    for peer in ("per-block", "op policy", "Megatron selective"):
        ours = by.get(f"fxckpt @{peer}")
        if ours is not None:
            lines.append(f"- {peer}: {ours.step_seconds / by[peer].step_seconds:.3f}x the time "
                         f"at {ours.peak_bytes / by[peer].peak_bytes:.3f}x the memory")
    lines.append("")
    return "\n".join(lines)


def render_exact(e: Exact, facts: dict[str, Any]) -> str:
    """:func:`exact_check`'s section."""
    optimum = "none fits" if e.optimum is None else f"{e.optimum:.1%}"
    return "\n".join([
        f"#### Against the exact optimum: {e.layers} layers at {e.fraction:g}",
        "",
        f"*Generated by `python -m benchmarks.predict --profile {facts['profile']} --model "
        f"{facts['model']} --layers {e.layers} --exact`.* The same model with {e.layers} layers "
        f"({e.ops} ops), planned at {e.fraction:g} of the simulator's unmodified peak "
        f"({e.eager_bytes / 2**30:.2f} GiB); what each plan adds to a step (recompute, hooks and "
        "segment overheads, less what kept outputs save), in shares of one forward:",
        "",
        "| | adds | how found |",
        "|---|---|---|",
        f"| fxckpt's search | {e.search:.1%} | {e.search_segments} segments, {e.search_kept} "
        f"kept outputs, in {e.search_seconds:.1f} s |",
        f"| exact optimum of segments alone | {optimum} | every segmentation, no limit, in "
        f"{e.optimum_seconds:.0f} s |",
        f"| floor | {e.floor:.1%} | no plan at this peak adds less |",
        "",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.predict",
                                description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="h100", choices=("h100", "h200", "a100"))
    p.add_argument("--model", default="llama3-8b", choices=tuple(MODELS))
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--seq", type=int, default=None, help="default: the model's")
    p.add_argument("--out", type=Path, default=None,
                   help="write predictions_<model>_<profile>.md there (default: print only)")
    p.add_argument("--exact", action="store_true",
                   help="also check the search against the exact optimum (a few --layers)")
    args = p.parse_args(argv)
    rows, facts = predict(args.profile, args.layers, args.seq, args.model)
    text = render(rows, facts)
    if args.exact:
        text += "\n" + render_exact(exact_check(args.profile, facts["layers"], None, args.seq,
                                                 args.model), facts)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"predictions_{args.model}_{args.profile}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
