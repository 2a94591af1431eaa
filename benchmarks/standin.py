"""Budgets without ``loss_fn``: does the measured step stay under them? (issue 33, part 4)

``python -m benchmarks.standin [--quick] [--out docs/standin.md]``

Most users do not pass ``loss_fn``; fxckpt then verifies plans with a stand-in loss
(:func:`fxckpt.measure.verify.stand_in_loss`). Each row plans a benchmark model *without*
``loss_fn``, then measures one training step with the model's real loss by the RSS protocol
(:mod:`fxckpt.measure`, a fresh process per row): the measured peak over the budget in bytes
must be at most :data:`TARGET`. Two kinds of budget: a fraction (0.5, of the verified unmodified
step) and bytes (0.5 of the unmodified step's measured peak, measured in the same process).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxckpt.measure import run_in_subprocess, step_memory, training_step

__all__ = ["measure", "main", "TARGET"]

TARGET = 1.05
"""Measured peak over the budget, at most."""
FRACTION = 0.5
ROWS = {
    "mlp_1024": "24 x Linear(1024) + GELU, batch 2048, loss o.square().mean()",
    "mlp": "bench MLP (24 x 256, batch 2048), cross-entropy",
    "gpt2": "HF GPT-2 (12 x 128, batch 4 x 128), loss on the last hidden state",
    "bert": "HF BERT (12 x 128, batch 4 x 128), loss on the last hidden state",
    "llama": "HF Llama (12 x 128, batch 4 x 128), cross-entropy over the logits",
    "gpt2_lm": "HF GPT2LMHeadModel (6 x 256, vocab 8192, batch 8 x 256), cross-entropy",
}


def _mlp_1024(quick: bool) -> tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]:
    width, depth, batch = (128, 6, 256) if quick else (1024, 24, 2048)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).train(), (torch.randn(batch, width),), \
        lambda o: o.square().mean()


def _gpt2_lm(quick: bool) -> tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, vocab, batch, seq = (2, 64, 512, 2, 64) if quick else (6, 256, 8192, 8, 256)
    attention: dict[str, Any] = {"attn_implementation": "sdpa"}  # a kwarg the stubs lack
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                        n_positions=seq, use_cache=False, **attention)
    ids = torch.randint(vocab, (batch, seq))
    return GPT2LMHeadModel(config).train(), (ids,), \
        lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def _build(model: str, quick: bool) -> tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]:
    if model == "mlp_1024":
        return _mlp_1024(quick)
    if model == "gpt2_lm":
        return _gpt2_lm(quick)
    from benchmarks.models import spec_for

    spec = spec_for(model)
    return spec.build(spec.quick if quick else spec.full)


def measure(model: str, kind: str, quick: bool = False, repeats: int = 3) -> dict[str, Any]:
    """One row, in this process (run it in a fresh one: :func:`main` does)."""
    import fxckpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    built, inputs, loss = _build(model, quick)
    eager = step_memory(training_step(built, inputs, loss), repeats, tracked=False)["rss_bytes"]
    budget: Any = FRACTION if kind == "fraction" else int(FRACTION * eager)
    built.zero_grad(set_to_none=True)
    try:
        tm = fxckpt.transform(built, budget=budget, example_inputs=inputs)
    except fxckpt.BudgetInfeasibleError as e:
        return {"model": model, "kind": kind, "eager_rss": eager, "budget_bytes": e.budget,
                "infeasible": e.min_budget}
    plan = fxckpt.inspect(tm).plan
    measured = step_memory(training_step(tm, inputs, loss), repeats, tracked=False)["rss_bytes"]
    assert plan.budget_bytes is not None
    return {"model": model, "kind": kind, "eager_rss": eager, "budget_bytes": plan.budget_bytes,
            "verified_peak": plan.verified_peak, "measured": measured,
            "ratio": measured / plan.budget_bytes, "of_eager": measured / eager,
            "segments": len(plan.segments)}


def _row(r: dict[str, Any]) -> str:
    mib = 2.0 ** 20
    if "infeasible" in r:
        return (f"| {r['model']} | {r['kind']} | {r['eager_rss'] / mib:.1f} | "
                f"{r['budget_bytes'] / mib:.1f} | infeasible: the smallest plan verifies at "
                f"{r['infeasible'] / mib:.1f} | - | - | - | - | n/a |")
    ok = "PASS" if r["ratio"] <= TARGET else "FAIL"
    return (f"| {r['model']} | {r['kind']} | {r['eager_rss'] / mib:.1f} | "
            f"{r['budget_bytes'] / mib:.1f} | {(r['verified_peak'] or 0) / mib:.1f} | "
            f"{r['measured'] / mib:.1f} | {r['ratio']:.3f} | {r['of_eager']:.3f} | "
            f"{r['segments']} | {ok} |")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.standin", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--models", default=",".join(ROWS), help="comma-separated")
    p.add_argument("--out", type=Path, help="write the Markdown table here")
    a = p.parse_args(argv)
    rows = []
    for model in [m for m in a.models.split(",") if m]:
        for kind in ("fraction", "bytes"):
            r = run_in_subprocess("benchmarks.standin:measure",
                                  {"model": model, "kind": kind, "quick": a.quick})
            print(json.dumps(r), flush=True)
            rows.append(r)
    text = "\n".join([
        "# Budgets without `loss_fn`", "",
        "*Generated by `python -m benchmarks.standin`; re-run it to refresh.* Each row plans "
        f"the model with `budget=` ({FRACTION} as a fraction, or {FRACTION} of the unmodified "
        "step's measured peak in bytes) and **no `loss_fn`**, so the plan is verified with the "
        "stand-in loss (`fxckpt.measure.verify.stand_in_loss`); then one step with the "
        "model's real loss is measured by the RSS protocol (median of 3 steps, a fresh process "
        "per row). *ratio*: "
        f"measured peak over the budget in bytes; target <= {TARGET}. Machine: "
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        "one thread.", "",
        *(f"* **{m}**: {d}" for m, d in ROWS.items() if any(r["model"] == m for r in rows)), "",
        "| model | budget | eager MiB | budget MiB | verified MiB | measured MiB | ratio | "
        "of eager | segments | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in rows), ""])
    if a.out is not None:
        a.out.write_text(text)
    print(text)
    return 0 if all(r.get("ratio", 0.0) <= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
