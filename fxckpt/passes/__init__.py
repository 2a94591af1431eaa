"""Rewrites of a planned ``torch.fx`` graph: each changes a GraphModule in place and ends with
``graph.lint()`` and ``recompile()``.

* :mod:`~fxckpt.passes.lower`: a plan's segments become checkpointed submodules;
* :mod:`~fxckpt.passes.flatten`: segments inlined again, for inspection.

The rewrites that make an exported graph call what eager code calls run at capture
(:mod:`fxckpt.capture.simplify`, :mod:`fxckpt.capture.eager_attention`).
"""
