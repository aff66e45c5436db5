"""Measurement instruments of the benches (infer.bench, train.bench, infer.accelerator_check):
what they decode, how they time it, returned as numbers. The `*_bench.py` modules are
infer.bench's modes, one each: they print its tables (the entry point only parses the flags)."""
