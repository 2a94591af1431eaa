"""The serve path: which plan runs each training call, made when a call first needs it.

    tm(x) --> dispatch.Dispatcher --Dynamo (default)--> dynamo/: each graph Dynamo captures,
                 |                                        planned per module, run eagerly
                 +--one whole graph-------------------> whole_graph: capture, plan, rewrite
                                                          (stages, save, loss_fn, FSDP2, ...)
    under a budget, both by size: plan_cache.PlanCache over a plan_cache.Planner
    (reuse a larger plan, power-of-two buckets, the unmodified step first: sizes)

:mod:`~fxckpt.serve.dispatch` chooses the path and keeps the whole-graph captures;
:mod:`~fxckpt.serve.dynamo` compiles the forward with fxckpt as Dynamo's backend;
:mod:`~fxckpt.serve.whole_graph` plans one captured graph;
:mod:`~fxckpt.serve.plan_cache` is the one size policy, which calls a graph's plans through one
typed interface (:class:`~fxckpt.serve.plan_cache.Planner`), implemented for a whole graph and
for a graph Dynamo made dynamic.
"""
