"""Capture: a model turned into one ``torch.fx`` graph per call structure, and the Python facts
that graph depends on (guards), with the model left as it was found.

:mod:`fxckpt.capture.captured` is the entry point (``capture``, ``Captured``): ``symbolic_trace``
(:mod:`~fxckpt.capture.tracer`), else non-strict ``torch.export``
(:mod:`~fxckpt.capture.exporter`).
"""
