"""Benchmarks: speed, memory and fidelity against exact attention."""
