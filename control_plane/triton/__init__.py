"""Triton servers: launching, model-control calls, GPU / MIG devices."""
