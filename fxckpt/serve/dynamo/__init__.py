"""Training calls through TorchDynamo: the model's Python runs as Python, its tensors as graphs.

``fxckpt.transform(model, capture="dynamo", ...)`` hands each training call to
``torch.compile(model's forward, backend=fxckpt)``. Dynamo owns what a frozen graph cannot know
(guards on every Python value the forward reads, side effects on Python objects replayed after
the graph, graph breaks where Python cannot be captured, recompiles with limits); fxckpt owns
what it is for: each Dynamo graph is annotated, planned (every, depth, force, budget, selective)
and lowered by the same passes as a captured graph, and run by the same runtime, eagerly: the
same kernels in the same order as the model, so the same bits.

    call --Dynamo: guards, Python between graphs--> graph 0 --> graph 1 --> ...
                                                    (SharedGraph: what Dynamo caches)
                                                      | the running module's plan of it
                                                      | (plan_graph: annotate, select, fit,
                                                      v  lower; made once per module)
                                                    GraphRunner (runtime: checkpoint, keep)

:mod:`fxckpt.serve.dynamo.backend` plans one graph; :mod:`fxckpt.serve.dynamo.cache` is what
Dynamo caches (one backend, graphs shared by modules); :mod:`fxckpt.serve.dynamo.driver`
compiles the forward, turns on the guards Dynamo leaves off by default, and keeps the graphs a
step runs (in order, with the break before each) so that a budget holds across graph breaks;
:mod:`fxckpt.serve.dynamo.sized` serves a dynamic graph's calls by the plan cache's size policy
under a budget. Every module compiles with one backend function, so a frame several modules run
(a block's ``forward`` after a break in a loop) keeps one graph per guard set, each module
running its own plan of it.
"""

from fxckpt.serve.dynamo.backend import GraphRecord, GraphRunner, plan_graph
from fxckpt.serve.dynamo.cache import SharedGraph
from fxckpt.serve.dynamo.driver import DynamoDriver
from fxckpt.serve.dynamo.refusals import refuse_fsdp, sharded

__all__ = ["DynamoDriver", "GraphRecord", "GraphRunner", "SharedGraph", "plan_graph",
           "refuse_fsdp", "sharded"]
