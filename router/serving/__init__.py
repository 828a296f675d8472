"""Serving one request: the Router, its decision, sending to Triton, answers, the state it serves from, the worker process."""
