"""Pipelines: stages cut from an annotated graph (:mod:`~fxckpt.pipeline.partition`) and the
pipelined module that runs them (:mod:`~fxckpt.pipeline.build`; the schedule itself runs in
:mod:`fxckpt.runtime.pipeline`).
"""
