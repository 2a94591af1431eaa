"""Fit: select and lower a plan, verify its peak by running it, and tighten until it holds.

    annotated gm --select--> Plan --lower (a copy)--> rewritten gm --verify--> verified peak
         ^                                                                        |
         +------------- over the budget: solve again, the overshoot taken off ----+
         +------------- well under it: solve again, the over-prediction given back +

The simulator plans; execution on fake tensors (:mod:`fxckpt.measure.verify`) checks. A budget is a
promise about what the step holds, so a budget plan whose verified peak is over the budget is
solved again with the solver's target lowered by the overshoot, a few times; then the plan with
the smallest simulated peak is tried, and when even that one's verified peak is over, the budget
is refused with :class:`~fxckpt.errors.BudgetInfeasibleError` whose ``min_budget`` is that
verified figure (a budget of ``min_budget`` then fits). Each step lowers the target by at least
the overshoot, so the first plan that fits may sit far under the budget; targets between the
last one over and the one that fits are then tried (:data:`BISECTIONS`), and the cheapest plan
that fits is taken.

The simulator errs the other way too: it sets aside the largest gradient for backward
temporaries wherever the peak falls, and a plan whose peak sits where those are small holds less
than predicted (a Llama-style model at 9.4 MiB: predicted 9.4, verified 8.4, the 1 MiB logits
gradient set aside in the middle of backward). Memory the budget allows and the plan leaves
unused is recompute paid for nothing, so a fitting plan whose prediction exceeds its verified
peak by more than :data:`LOOSEN_FROM` of the budget is solved once more with the target raised
by that gap, and the new plan is taken when its verified peak fits and it recomputes less. Only
with the user's ``loss_fn``: the stand-in loss holds less than cross-entropy does (about 1.5x
the logits on that Llama at most budgets), and the slack the first plan leaves is what covers
it; a plan fitted to the stand-in's figure measured up to 8% over the budget.

A fraction resolves against the verified peak of the unmodified step, so ``budget=0.3`` means
0.3 of what the step really holds. Plans without a budget are verified too (unless
``verify=False``) and only reported. When the step cannot run on fake tensors (a custom
``autograd.Function`` that reads values, say), the plan keeps its simulated figures and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch.fx

from fxckpt.budget import Budget
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.errors import BudgetInfeasibleError, VerifyError
from fxckpt.passes.lower import lower
from fxckpt.plan import Plan, format_bytes
from fxckpt.runtime.segment import Offloading

__all__ = ["fit", "infeasible", "Target", "ATTEMPTS", "LOOSEN_FROM", "BISECTIONS", "WIDENINGS"]

log = logging.getLogger(__name__)

ATTEMPTS = 4
"""Solves (the first included) before the smallest plan is tried."""
LOOSEN_FROM = 0.02
"""Over-prediction (share of the budget) worth solving again for."""
BISECTIONS = 3
"""Targets tried between one whose plan was over the budget and one whose plan fits."""
WIDENINGS = 4
"""Raised targets bisected when widening a plan for a step that holds less than simulated."""



@dataclasses.dataclass(frozen=True)
class Target:
    """What the budget solver aims under, as fitting steers it.

    The budget's bytes are resolved from the user's :class:`~fxckpt.budget.Budget` here
    (:meth:`limit`), and moved only by what verification found (:meth:`aim`); the solver's
    reserve for temporaries is part of its problem and counted there. Fitting makes and changes
    targets; :func:`fxckpt.planning.strategies.budgeted` and ``select`` only read them.
    """

    eager_bytes: Optional[int] = None
    """The verified peak of the unmodified step: what a fractional budget is a fraction of
    (``None``: the simulated one)."""
    lowered: int = 0
    """Bytes taken off the budget: what verification found plans over it by, so far."""
    raised: int = 0
    """Bytes given back: what verification found a fitting plan under its prediction by (only
    with the user's loss, see :func:`fit`)."""
    minimum: bool = False
    """Ask for the plan with the smallest simulated peak, whatever it recomputes."""
    per_block: bool = False
    """With ``minimum``: one segment per repeated block instead, as a user of
    ``torch.utils.checkpoint`` places them, the other candidate for the smallest verified peak."""

    def set_aside(self, simulated_eager: int) -> int:
        """What the verified unmodified step held beyond the simulator's figure for it: the
        backward temporaries the simulator does not model (0 when not verified)."""
        return 0 if self.eager_bytes is None else max(0, self.eager_bytes - simulated_eager)

    def eager(self, simulated_eager: int) -> int:
        """The unmodified step's peak: verified when known, else simulated."""
        return simulated_eager if self.eager_bytes is None else self.eager_bytes

    def limit(self, budget: Budget, simulated_eager: int) -> int:
        """``budget`` in bytes (a fraction is of :meth:`eager`)."""
        return budget.resolve(self.eager(simulated_eager))

    def aim(self, limit: int, simulated_eager: int) -> int:
        """The simulated peak a plan for ``limit`` may reach: less what verification sets aside
        for every plan and found over so far, plus what it gave back."""
        return limit - self.set_aside(simulated_eager) - self.lowered + self.raised

    def allowed(self, limit: int) -> int:
        """The largest predicted peak a plan for ``limit`` may report without a note: past the
        budget only where fitting raised the aim on purpose."""
        return limit + max(0, self.raised - self.lowered)


PlanAt = Callable[[Target], Plan]
"""``select`` on the annotated graph with a given :class:`Target`."""
Verify = Callable[[torch.fx.GraphModule], int]
"""The verified peak of one training step of a graph module (raises ``VerifyError``)."""
Check = Callable[[Plan], tuple[Plan, torch.fx.GraphModule]]
"""A plan lowered on a copy of the base graph and verified: the plan with its verified peaks,
and the graph that runs it."""


def fit(base: torch.fx.GraphModule, plan_at: PlanAt, verify: Optional[Verify], *,
        solved: bool = True, loosen: bool = False, eager: Optional[int] = None,
        offloader: Optional[Offloading] = None, widen: bool = False,
        fraction_of: Optional[int] = None) -> tuple[Plan, torch.fx.GraphModule]:
    """The plan for the annotated ``base`` and the rewritten graph that runs it.

    ``base`` is left unlowered when ``verify`` is given (each attempt lowers a copy). Only a
    ``solved`` plan (``budget=``) is tightened; others (``every=``, a replayed plan) are verified
    and reported as they are. ``loosen``: a fitting plan verified well under its prediction is
    solved again (only when ``verify`` runs the user's own loss: see the module docstring).
    ``eager``: ``verify(base)``, when the caller measured it already. ``offloader``: what the
    segments a plan offloads run under (:func:`fxckpt.passes.lower.lower`). ``widen``: ``verify``
    measures a step that holds far less than the simulator's (the compiled step,
    :mod:`fxckpt.measure.compiled_step`): a fitting plan is widened (:func:`_widened`).
    ``fraction_of``: what a fractional budget is a fraction of, when not ``verify(base)`` (the
    eager step's verified peak, for a budget fitted to the compiled step).
    """
    if verify is None:
        plan = plan_at(Target())
        return plan, lower(base, plan, offloader)
    try:
        if eager is None:
            eager = verify(base)
        measured = eager

        def check(plan: Plan) -> tuple[Plan, torch.fx.GraphModule]:
            gm = lower(copy_graph_module(base), plan, offloader)
            # With no segment the lowered graph runs base's ops in base's order (lowering only
            # moves placeholders first and drops unused get_attr nodes): its peak is the eager one.
            peak = verify(gm) if plan.segments else measured
            return dataclasses.replace(plan, verified_peak=peak, verified_eager_peak=measured), gm

        if not solved:
            return check(plan_at(Target()))
        return _tightened(plan_at, check, eager, loosen, widen, fraction_of)
    except VerifyError as e:
        log.warning("fxckpt: %s", e)
        plan = plan_at(Target())
        return (_note(plan, f"the peak is simulated, not verified: {e}"),
                lower(base, plan, offloader))


def _tightened(plan_at: PlanAt, check: Check, eager: int, loosen: bool, widen: bool = False,
               fraction_of: Optional[int] = None) -> tuple[Plan, torch.fx.GraphModule]:
    target, over = Target(eager_bytes=eager if fraction_of is None else fraction_of), None
    for attempt in range(ATTEMPTS):
        try:
            plan, gm = check(plan_at(target))
        except BudgetInfeasibleError:
            break  # the solver has nothing smaller: try the smallest plan
        budget = plan.budget_bytes
        assert plan.verified_peak is not None
        if budget is None or plan.verified_peak <= budget:
            best, best_gm = plan, gm
            if over is not None:
                best, best_gm, target = _between(plan_at, check, over, target, plan, gm)
            fitted = _tighten_note(best, attempt, target.lowered)
            if widen and budget is not None:
                return _widened(plan_at, check, target, fitted, best_gm)
            if loosen and budget is not None:
                return _loosened(plan_at, check, target, fitted, best_gm)
            return fitted, best_gm
        log.info("fxckpt: plan verified at %s, over the budget %s; solving again",
                 format_bytes(plan.verified_peak), format_bytes(budget))
        over = target
        target = dataclasses.replace(target, lowered=_next_lowered(plan, target, attempt))
    return _smallest(plan_at, check, target)


def _between(plan_at: PlanAt, check: Check, over: Target, fits: Target, plan: Plan,
             gm: torch.fx.GraphModule) -> tuple[Plan, torch.fx.GraphModule, Target]:
    """The cheapest plan that fits, from targets bisected between ``over`` (its plan was
    verified over the budget) and ``fits`` (``plan``, which fits).

    Each tightening step lowers the target by at least the overshoot, doubled at every attempt,
    so the plan that fits may sit far under the budget and recompute more than a plan for a
    target in between: a budget raised by 3% then gave a plan 15% further under it at 1.5x the
    recompute. While the fitting plan leaves more than :data:`LOOSEN_FROM` of the budget unused,
    up to :data:`BISECTIONS` targets in between are tried.
    """
    assert plan.budget_bytes is not None
    for _ in range(BISECTIONS):
        assert plan.verified_peak is not None
        if plan.budget_bytes - plan.verified_peak <= plan.budget_bytes * LOOSEN_FROM \
                or fits.lowered - over.lowered <= plan.budget_bytes * LOOSEN_FROM:
            break
        middle = dataclasses.replace(fits, lowered=(over.lowered + fits.lowered) // 2)
        try:
            tried, tried_gm = check(plan_at(middle))
        except BudgetInfeasibleError:
            break
        assert tried.verified_peak is not None
        if tried.verified_peak > plan.budget_bytes:
            over = middle
        else:
            fits = middle
            if _recomputes_less(tried, plan):
                plan, gm = tried, tried_gm
    return plan, gm, fits


def _next_lowered(plan: Plan, target: Target, attempt: int) -> int:
    """How much further below the budget the solver aims next.

    Two guesses, the larger wins: this plan's own gap (what its verified peak held beyond its
    predicted one, less what the calibration already set aside), which fits when the next plan's
    gap is alike; and the overshoot, at least 1% of the budget, doubled at every attempt, since
    the verified peak may sit where the simulator's does not, where a small step changes nothing.
    """
    assert plan.budget_bytes is not None and plan.verified_peak is not None
    assert plan.predicted_peak is not None and plan.eager_peak is not None
    own_gap = plan.verified_peak - plan.predicted_peak - target.set_aside(plan.eager_peak)
    step = max(plan.verified_peak - plan.budget_bytes, plan.budget_bytes // 100) << attempt
    return max(target.lowered + step, own_gap)


def _loosened(plan_at: PlanAt, check: Check, target: Target, plan: Plan,
              gm: torch.fx.GraphModule) -> tuple[Plan, torch.fx.GraphModule]:
    """``plan`` (which fits), or a plan solved with the target raised by what ``plan``'s
    prediction exceeded its verified peak, when that one fits too and recomputes less."""
    assert plan.budget_bytes is not None and plan.verified_peak is not None
    assert plan.predicted_peak is not None and plan.eager_peak is not None
    raise_by = plan.predicted_peak + target.set_aside(plan.eager_peak) - plan.verified_peak
    if raise_by <= plan.budget_bytes * LOOSEN_FROM:
        return plan, gm
    looser, looser_gm = check(plan_at(
        dataclasses.replace(target, raised=target.raised + raise_by)))
    assert looser.verified_peak is not None
    if looser.verified_peak > plan.budget_bytes or not _recomputes_less(looser, plan):
        return plan, gm  # the gap was where this plan peaks only
    note = (f"verification found the first plan {format_bytes(raise_by)} under its prediction; "
            f"solved again with the target raised by that")
    log.info("fxckpt: %s", note)
    return _note(looser, note), looser_gm


def _widened(plan_at: PlanAt, check: Check, target: Target, plan: Plan,
             gm: torch.fx.GraphModule) -> tuple[Plan, torch.fx.GraphModule]:
    """The plan that recomputes least among those whose measured peak fits, with the target
    raised anywhere from where ``plan`` (which fits) was solved up to the unmodified step.

    For a step that holds far less than the simulator counts (compiled: inductor's partitioner
    recomputes cheap ops outside the segments too), one loosening is not enough: GPT-2 at
    ``torch.compile``'s own peak held 0.69 of it compiled. The largest raise, no segment at all,
    is tried first; then :data:`WIDENINGS` raises bisected between the last that fit and the
    first that did not.
    """
    assert plan.budget_bytes is not None and plan.eager_peak is not None
    budget = plan.budget_bytes
    fits = target.raised
    over = target.raised + max(0, plan.eager_peak - target.aim(budget, plan.eager_peak)) + 1
    best, best_gm = plan, gm
    for step in range(WIDENINGS + 1):
        raised = over if step == 0 else (fits + over) // 2
        if raised - fits <= budget * LOOSEN_FROM:
            break
        try:
            tried, tried_gm = check(plan_at(dataclasses.replace(target, raised=raised)))
        except BudgetInfeasibleError:
            break
        assert tried.verified_peak is not None
        log.debug("fxckpt: widening by %s: %d segment(s), %s measured", format_bytes(raised),
                  len(tried.segments), format_bytes(tried.verified_peak))
        if tried.verified_peak > budget:
            over = raised
            continue
        fits = raised
        if _recomputes_less(tried, best):
            best, best_gm = tried, tried_gm
        if step == 0:
            break  # the unmodified step fits
    if best is plan:
        return plan, gm
    unused = format_bytes(budget - (plan.verified_peak or 0))
    note = (f"widened: the first plan that fit held {unused} under the budget as measured; "
            f"solved again with the target raised by up to "
            f"{format_bytes(fits - target.raised)}, for the plan that recomputes least and fits")
    log.info("fxckpt: %s", note)
    return _note(best, note), best_gm


def _recomputes_less(plan: Plan, than: Plan) -> bool:
    return (plan.recompute_share or 0.0) < (than.recompute_share or 0.0)


def _smallest(plan_at: PlanAt, check: Check,
              target: Target) -> tuple[Plan, torch.fx.GraphModule]:
    """The smallest-peak plan when it fits the budget; else one segment per repeated block when
    that fits (the simulator picks the first, and may be wrong where it peaks: a loss it assumed
    smaller than it is); else the budget is refused with the smaller of their verified peaks."""
    assert target.eager_bytes is not None
    least = dataclasses.replace(target, minimum=True)
    plan, gm = check(plan_at(least))
    assert plan.budget_bytes is not None and plan.verified_peak is not None
    if plan.verified_peak > plan.budget_bytes:
        blocks = plan_at(dataclasses.replace(least, per_block=True))
        if blocks.segments and _nodes(blocks) != _nodes(plan):
            plan, gm = min([(plan, gm), check(blocks)],
                           key=lambda p: p[0].verified_peak or 0)
    assert plan.budget_bytes is not None and plan.verified_peak is not None
    if plan.verified_peak <= plan.budget_bytes:
        return _note(plan, "tightened to the plan with the smallest peak to fit the budget"), gm
    raise infeasible(plan.budget_bytes, plan.verified_peak, target.eager_bytes, verified=True)


def infeasible(budget: int, least: int, eager: int, *, asked: str = "",
               verified: bool = False) -> BudgetInfeasibleError:
    """The error for a budget of ``budget`` bytes that no plan meets, whose smallest peak is
    ``least`` bytes against the unmodified step's ``eager``: its message is built here only.
    ``asked``: the budget as the user gave it, when that was not bytes (``0.5 of the eager
    peak``); ``verified``: ``least`` was measured by running the plan on fake tensors."""
    shown = f"{asked} = {format_bytes(budget)}" if asked else format_bytes(budget)
    how = ", verified by running the plan on fake tensors" if verified else ""
    share = (f"; {least / eager:.3f} of the unmodified step's {format_bytes(eager)}"
             if eager else "")
    fraction = f"; a fraction >= {least / eager:.3f}" if eager else ""
    return BudgetInfeasibleError(
        budget, least,
        f"budget {shown} ({budget} bytes) cannot be met: the smallest peak activation memory any "
        f"plan reaches for this model and input is {format_bytes(least)} ({least} bytes{how}"
        f"{share}). Give budget >= {least} (bytes{fraction}), or, for a budget in bytes, a "
        "smaller batch (a fraction of a smaller step is harder to meet: weight gradients and the "
        "loss do not shrink with it)",
    )


def _nodes(plan: Plan) -> list[tuple[str, ...]]:
    return [seg.nodes for seg in plan.segments]


def _tighten_note(plan: Plan, attempt: int, lowered: int) -> Plan:
    if attempt == 0:
        return plan
    return _note(plan, f"verification found the first plan over the budget; solved again "
                       f"{attempt} time(s) with the target lowered by {format_bytes(lowered)}")


def _note(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))
