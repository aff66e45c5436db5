"""Measurement instruments of the benches (infer.bench, train.bench, infer.accelerator_check):
what they decode, how they time it. The entry points print; these return numbers."""
