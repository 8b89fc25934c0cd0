"""Batched sampling on the device: per-row parameters, logits processors, the sampler."""
