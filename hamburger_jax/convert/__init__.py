"""Checkpoint conversion: GGUF, HF safetensors, the release's Lightning checkpoint."""
