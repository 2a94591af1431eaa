"""Costs: what each node of a captured graph produces, saves for backward and costs to run again
(:mod:`~fxckpt.cost.annotate`, in FLOP-equivalents: :mod:`~fxckpt.cost.flops`,
:mod:`~fxckpt.cost.prices`, :mod:`~fxckpt.cost.devices`), and the one bridge from an annotated
graph to the solver's plain data (:mod:`~fxckpt.cost.bridge`).
"""
