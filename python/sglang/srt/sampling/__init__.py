"""Sampling parameters and their batched form."""
