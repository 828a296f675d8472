"""Benchmarks.  Each module runs alone (``python -m bench.<module> --help``) and writes its
results under ``bench/results/``."""
