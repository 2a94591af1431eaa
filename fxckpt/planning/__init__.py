"""Planning: from an annotated graph to a :class:`~fxckpt.plan.Plan`.

:mod:`~fxckpt.planning.select` runs a strategy (:mod:`~fxckpt.planning.strategies`) and the
rules every segment obeys (:mod:`~fxckpt.planning.cleanup`); :mod:`~fxckpt.planning.fit`
verifies a budget plan on fake tensors and tightens it until it holds;
:mod:`~fxckpt.serve.plan_cache` says which plan serves a call's shapes.
"""
