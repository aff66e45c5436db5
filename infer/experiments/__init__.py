"""Experiment probes, python -m infer.experiments.NAME: the measurements behind docs/results/.

`python -m infer` lists them after the entry points. Each answers a question about the method
(what a merged entry carries, what a step's parts cost, how far bfloat16 strays) rather than
serving, evaluating or benchmarking a model: not a user's tools.
"""
