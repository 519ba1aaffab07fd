"""Benchmark suites: run each as ``python -m benchmarks.NAME``."""
